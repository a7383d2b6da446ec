"""CPU decode speed: bfloat16 linear layers through oneDNN with weights packed once.

SGLang's UnquantizedLinearMethod.apply ends in `F.linear(x, layer.weight, bias)`; on a CPU in
bfloat16 that reorders the weight into oneDNN's blocked layout at every call. This AROUND hook
runs superinfer_sgl.cpu_attention.linear.linear instead (packed copy cached on the layer,
bit-identical results) when x is a bfloat16 CPU tensor and the layer is a plain dense one; every
other case (CUDA, float32, Intel AMX sgl_kernel builds, subclassed weights) calls the original.

Switch: registered by our plugin together with the batched CPU attention (cpu_attention_enabled():
SUPERINFER_CPU_ATTENTION, which follows SUPERINFER_CPU_COMPAT when unset);
SUPERINFER_CPU_FAST_OPS=0 leaves it (and the other CPU op patches) out.
"""

from __future__ import annotations

from typing import Any, Callable

from . import check_target

TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"


def _apply(original: Callable[..., Any], self: Any, layer: Any, x: Any, bias: Any = None) -> Any:
    from superinfer_sgl.cpu_attention import linear

    weight = getattr(layer, "weight", None)
    if weight is not None and linear.supported(x, weight, bias) and not getattr(layer, "use_intel_amx_backend", False):
        return linear.linear(layer, x, weight, bias)
    return original(self, layer, x, bias)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _apply, HookType.AROUND)
