"""CPU attention: SGLang builds our batched backend wherever it would build torch_native's.

Stock TorchNativeAttnBackend attends one request at a time (a Python loop of gathers and SDPA
calls per layer); superinfer_sgl.cpu_attention.backend.SuperInferCpuAttnBackend subclasses it
and batches decode across requests. This patch REPLACEs the class at its definition site;
attention_registry's `torch_native` factory imports it lazily, so it builds ours.

Why not a new backend name: SGLang gates its torch fallbacks for Triton-only helpers on the
literal name "torch_native" (mem_cache/allocation.py get_last_loc and write_req_to_token_pool,
utils/common.py support_triton -> compute_position); any other name sends them to Triton
kernels, which do not run on a CPU. So the user-visible name stays `--attention-backend
torch_native` and this patch decides which implementation serves it.

Switch: superinfer_sgl.cpu_attention.cpu_attention_enabled() (SUPERINFER_CPU_ATTENTION=1/0;
unset, it follows SUPERINFER_CPU_COMPAT), read by our plugin in every SGLang process.
"""

from __future__ import annotations

from . import check_target

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
# The factory that must keep importing TARGET lazily for the REPLACE to reach it.
FACTORY = "sglang.srt.layers.attention.attention_registry.create_torch_native_backend"


def check() -> None:
    check_target(TARGET)
    check_target(FACTORY)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from superinfer_sgl.cpu_attention.backend import SuperInferCpuAttnBackend

    check()
    HookRegistry.register(TARGET, SuperInferCpuAttnBackend, HookType.REPLACE)
