"""CPU decode speed: the bfloat16 lm_head product through oneDNN with the weight packed once.

LogitsProcessor._compute_lm_head computes `torch.matmul(hidden, lm_head.weight.T)` for a plain
lm_head; on a CPU in bfloat16 oneDNN reorders the [vocab, hidden] weight at every call (for
SmolLM2-135M, 56 MB per decode step). This AROUND hook takes that exact branch's case (no LoRA,
no quantized or fp32 lm_head, no AMX, no RL on-policy mode, bfloat16 CPU hidden states and
weight) through superinfer_sgl.cpu_attention.linear (bit-identical results); everything else
calls the original. The packed copy is cached on the lm_head module (tied embeddings keep their
own weight untouched).

Switch: as patches/linear_packed_cpu.py (cpu_attention_enabled(), SUPERINFER_CPU_FAST_OPS=0 off).
"""

from __future__ import annotations

from typing import Any, Callable

from . import check_target

TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"


def _fast_ok(self: Any, hidden_states: Any, lm_head: Any, embedding_bias: Any) -> bool:
    from sglang.srt.layers import logits_processor as lp

    from superinfer_sgl.cpu_attention import linear

    weight = getattr(lm_head, "weight", None)
    return (
        weight is not None
        and embedding_bias is None
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not lp.should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        and not getattr(self, "use_fp32_lm_head", False)
        and not getattr(lm_head, "use_intel_amx_backend", False)
        and getattr(self, "rl_on_policy_target", None) is None
        and hidden_states.dim() == 2
        and linear.supported(hidden_states, weight, None)
    )


def _compute_lm_head(original: Callable[..., Any], self: Any, hidden_states: Any, lm_head: Any,
                     embedding_bias: Any = None, **kwargs: Any) -> Any:
    if _fast_ok(self, hidden_states, lm_head, embedding_bias):
        from superinfer_sgl.cpu_attention import linear

        return linear.linear(lm_head, hidden_states, lm_head.weight)
    return original(self, hidden_states, lm_head, embedding_bias, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _compute_lm_head, HookType.AROUND)
