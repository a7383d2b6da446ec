"""CPU decode speed: rotary embedding in one C call per tensor.

Without SGLang's Intel-AMX sgl_kernel build, RotaryEmbedding on a CPU runs forward_native:
index_select, chunk, and per q/k a cast, four multiplies, an add, a sub, two cats (about 20
torch ops per layer). This AROUND hook computes the same with
superinfer_sgl.cpu_attention.ops.rope, rounding at every step as the torch ops do (bit-identical
in float32 and bfloat16), for 2-D float32/bfloat16 CPU q/k with int64 positions and a cos/sin
cache of the same dtype; offsets, a precomputed sin_cos_cache, a swapped (compiled)
apply_rotary_emb or any other case calls the original. Outputs are new contiguous tensors of the
input shapes, as forward_native returns.

(patches/rotary_embedding_cpu.py is a different target: it only lets the constructor run on a CPU.)

Switch: as patches/linear_packed_cpu.py (cpu_attention_enabled(), SUPERINFER_CPU_FAST_OPS=0 off).
"""

from __future__ import annotations

from typing import Any, Callable

from . import check_target

TARGET = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native"


def _forward_native(original: Callable[..., Any], self: Any, positions: Any, query: Any, key: Any,
                    offsets: Any = None, fused_set_kv_buffer_arg: Any = None) -> Any:
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    from superinfer_sgl.cpu_attention import ops

    cache = getattr(self, "cos_sin_cache", None)
    if (
        offsets is None
        and fused_set_kv_buffer_arg is None
        and key is not None
        and cache is not None
        and not hasattr(self, "sin_cos_cache")
        and getattr(self, "_apply_rotary_emb_wrapped", None) is apply_rotary_emb
        and positions.dim() == 1
        and ops.supports_rope(positions, query, self.head_size, self.rotary_dim, cache)
        and ops.supports_rope(positions, key, self.head_size, self.rotary_dim, cache)
    ):
        neox = bool(self.is_neox_style)
        return (
            ops.rope(positions, query, self.head_size, self.rotary_dim, cache, neox),
            ops.rope(positions, key, self.head_size, self.rotary_dim, cache, neox),
        )
    return original(self, positions, query, key, offsets, fused_set_kv_buffer_arg)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _forward_native, HookType.AROUND)
