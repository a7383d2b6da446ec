"""SuperInfer Triton kernels. Importable without SGLang (the GPU benchmark machine has none)."""

from superinfer_kernels.kv_fp8 import gather_kv_blocks_fp8, scatter_kv_blocks_fp8
from superinfer_kernels.kv_int4 import gather_kv_blocks_int4, scatter_kv_blocks_int4
from superinfer_kernels.kv_gather import gather_kv_blocks, gather_kv_blocks_reference
from superinfer_kernels.kv_scatter import scatter_kv_blocks, scatter_kv_blocks_reference

__all__ = [
    "gather_kv_blocks",
    "gather_kv_blocks_fp8",
    "gather_kv_blocks_int4",
    "gather_kv_blocks_reference",
    "scatter_kv_blocks",
    "scatter_kv_blocks_fp8",
    "scatter_kv_blocks_int4",
    "scatter_kv_blocks_reference",
]
