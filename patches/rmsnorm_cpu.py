"""CPU decode speed: RMSNorm (with the fused residual add) in one C call.

Without SGLang's Intel-AMX sgl_kernel build, RMSNorm on a CPU runs forward_native: about ten
torch ops per call (casts, add, pow, mean, rsqrt, two multiplies), two calls per layer.
This AROUND hook computes the same thing with superinfer_sgl.cpu_attention.ops.rmsnorm (float32
accumulation, the same rounding steps; only the summation order of the mean of squares differs)
for 2-D float32/bfloat16 CPU inputs whose weight has the input's dtype, and calls the original
for everything else (fp32 residual streams, variance_size_override, override_orig_dtype,
post_residual_addition, other devices, grad mode).

Switch: as patches/linear_packed_cpu.py (cpu_attention_enabled(), SUPERINFER_CPU_FAST_OPS=0 off).
"""

from __future__ import annotations

from typing import Any, Callable

from . import check_target

TARGET = "sglang.srt.layers.layernorm.RMSNorm.forward_native"


def _forward_native(original: Callable[..., Any], self: Any, x: Any, residual: Any = None,
                    post_residual_addition: Any = None, *args: Any, **kwargs: Any) -> Any:
    from superinfer_sgl.cpu_attention import ops

    if (
        post_residual_addition is None
        and not self.fp32_residual
        and self.override_orig_dtype is None
        and self.variance_size_override is None
        and x.dim() == 2
        and x.shape[-1] == self.hidden_size
        and ops.supports_rmsnorm(x, self.weight, residual)
    ):
        return ops.rmsnorm(x, self.weight, self.variance_epsilon, residual, self.cast_x_before_out_mul)
    return original(self, x, residual, post_residual_addition, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _forward_native, HookType.AROUND)
