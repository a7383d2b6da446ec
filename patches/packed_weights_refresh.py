"""CPU fast ops: drop the packed bf16 weight copies before an online weight update writes the weights.

The packed copies (superinfer_sgl.cpu_attention.linear) are keyed by the weight's pointer, shape and
version counter, but SGLang's weight loaders write through `param.data` (`copy_`, `narrow().copy_`),
which leaves the Parameter's version counter as it was: without this hook the packed layers and the
lm_head kept serving the old weights after `/update_weights_from_disk` (or from a tensor, from a
distributed group, over IPC). Every one of those updates first asks
`_unsupported_derived_weight_cache_error` whether derived weight caches allow it (SGLang's own
protocol for such caches); where the update goes ahead, this AFTER hook drops the model's packed
copies, and the next forward packs the new weights.

Switch: registered with the other CPU op patches (patches/linear_packed_cpu.py).
"""

from __future__ import annotations

from typing import Any

from . import check_target

TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater._unsupported_derived_weight_cache_error"


def _after(result: Any, model: Any = None, *args: Any, **kwargs: Any) -> Any:
    if result is None and model is not None:  # the update goes ahead
        from superinfer_sgl.cpu_attention import linear

        linear.drop_packed(model)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _after, HookType.AFTER)
