"""CPU decode speed: SiLU-and-mul in one C call.

Without SGLang's Intel-AMX sgl_kernel build, SiluAndMul on a CPU runs forward_native
(`F.silu(x[..., :d]) * x[..., d:]`: two ops and a temporary). This AROUND hook computes the same
with superinfer_sgl.cpu_attention.ops.silu_mul (silu in float32, rounded to the dtype, then the
product rounded, as the torch ops do; its exp differs from torch's Sleef exp in the last float32
bit at most) for 2-D float32/bfloat16 CPU inputs, and calls the original otherwise.

Switch: as patches/linear_packed_cpu.py (cpu_attention_enabled(), SUPERINFER_CPU_FAST_OPS=0 off).
"""

from __future__ import annotations

from typing import Any, Callable

from . import check_target

TARGET = "sglang.srt.layers.activation.SiluAndMul.forward_native"


def _forward_native(original: Callable[..., Any], self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    from superinfer_sgl.cpu_attention import ops

    if not args and not kwargs and ops.supports_silu_mul(x):
        return ops.silu_mul(x)
    return original(self, x, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _forward_native, HookType.AROUND)
