"""CPU compatibility: a torch fallback for the shared-expert gate of Qwen2-MoE-style models.

Qwen2MoeSparseMoeBlock.forward (models/qwen2_moe.py, also used by the Qwen3-MoE family's shared
expert path) gates its shared expert with `fused_gate_sigmoid_mul_add` / `fused_gate_sigmoid_mul`
unless the gate runs on Intel AMX or an NPU. Both launch one Triton kernel through
`_launch_fused_gate_sigmoid_mul`, which on a CPU without TRITON_INTERPRET fails with
"0 active drivers": stock SGLang cannot serve such a model on a CPU. This AROUND hook on that
launcher computes the kernel's result with torch for CPU tensors and calls the original otherwise:

    gate = sigmoid(sum(hidden * w))            per token, in float32
    output = gate * shared (+ output if do_add)  in float32, stored in output's dtype

The per-token sum is an elementwise product reduced over the hidden dimension (not a matmul), so a
token's gate does not depend on how many tokens share the batch.

Switch: SUPERINFER_CPU_COMPAT=1, as patches/rotary_embedding_cpu.py (our launcher sets it on CPU).
"""

from __future__ import annotations

from typing import Any, Callable

from . import check_target

TARGET = "sglang.kernels.ops.elementwise.elementwise._launch_fused_gate_sigmoid_mul"


def gate_sigmoid_mul(hidden_states: Any, gate_weight: Any, shared_output: Any, output: Any, *, do_add: bool) -> None:
    """The Triton kernel's semantics in torch: writes `output` in place."""
    gate = (hidden_states.float() * gate_weight.float()).sum(dim=-1, keepdim=True).sigmoid()
    result = gate * shared_output.float()
    if do_add:
        result = result + output.float()
    output.copy_(result)


def _launch(original: Callable[..., Any], hidden_states: Any, gate_weight: Any, shared_output: Any,
            output: Any, *args: Any, **kwargs: Any) -> Any:
    if hidden_states.device.type == "cpu" and not args and set(kwargs) == {"do_add"}:
        return gate_sigmoid_mul(hidden_states, gate_weight, shared_output, output, do_add=kwargs["do_add"])
    return original(hidden_states, gate_weight, shared_output, output, *args, **kwargs)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _launch, HookType.AROUND)
