"""bfloat16 linear layers on the CPU with oneDNN weights packed once, not at every call.

`F.linear` on a bfloat16 CPU tensor runs oneDNN's matmul, which reorders the plain [N, K] weight
into its blocked layout on every call: at decode batch sizes that reorder costs about as much as
the product itself (SmolLM2-135M, 30 layers, batch 8, one core: 33 ms per step of linear layers
vs 18 ms with the weights packed once). torch exposes the packed path
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what torch.compile's CPU
freezing uses); its results are bit-identical to F.linear's for bfloat16 (same oneDNN kernel).

The packed copy is cached on the module, keyed by the weight's storage pointer, shape and
version counter (in-place weight updates bump it), so reloaded weights are repacked on the next
call; SGLang's online weight updates write through `param.data`, which does not bump it, so they
drop the copies first (`drop_packed`, patches/packed_weights_refresh.py). Cost: one extra copy of
every packed weight in memory, capped: once the packed copies would exceed
SUPERINFER_CPU_PACK_BUDGET_MB (default: a quarter of physical RAM), further layers keep F.linear
(same results, only slower). float32 is left alone: there F.linear runs MKL's
sgemm, and oneDNN's float32 results differ in the last bits.
"""

from __future__ import annotations

import os

import torch

BUDGET_ENV = "SUPERINFER_CPU_PACK_BUDGET_MB"
_ATTR = "_superinfer_packed_weight"
PACK_BATCH_HINT = 32  # oneDNN's batch-size hint for the blocked layout (results do not depend on it)


def _mkldnn_bf16_ok() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


_BF16_OK: bool | None = None


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    global _BF16_OK
    if not (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.dim() >= 2
        and x.shape[-1] == weight.shape[1]
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.dim() == 1))
        and not torch.is_grad_enabled()
    ):
        return False
    if _BF16_OK is None:
        _BF16_OK = _mkldnn_bf16_ok()
    return _BF16_OK


_packed_bytes = 0
_budget_bytes: int | None = None


def budget_bytes() -> int:
    global _budget_bytes
    if _budget_bytes is None:
        value = os.environ.get(BUDGET_ENV)
        if value:
            _budget_bytes = int(float(value) * (1 << 20))
        else:
            try:
                _budget_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
            except (ValueError, OSError, AttributeError):
                _budget_bytes = 4 << 30
    return _budget_bytes


def packed(owner: object, weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of `weight`, cached on `owner` (re-packed when the weight changes);
    None when packing it would exceed the memory budget."""
    global _packed_bytes
    key = (weight.data_ptr(), tuple(weight.shape), weight._version)
    cached = getattr(owner, _ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    size = weight.numel() * weight.element_size()
    freed = cached[2] if cached is not None else 0
    if _packed_bytes - freed + size > budget_bytes():
        object.__setattr__(owner, _ATTR, (key, None, 0))  # remembered: F.linear for this weight
        _packed_bytes -= freed
        return None
    pack = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
    object.__setattr__(owner, _ATTR, (key, pack, size))  # plain attribute: not a parameter or buffer
    _packed_bytes += size - freed
    return pack


def drop_packed(model: torch.nn.Module) -> int:
    """Forget every packed copy cached on `model`'s modules (their weights are about to be
    rewritten in place); the budget gets their bytes back. Returns how many were dropped."""
    global _packed_bytes
    dropped = 0
    for module in model.modules():
        cached = module.__dict__.pop(_ATTR, None)
        if cached is not None:
            _packed_bytes -= cached[2]
            dropped += 1
    return dropped


def linear(owner: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for bfloat16 CPU tensors (check `supported` first)."""
    pack = packed(owner, weight) if x.numel() else None
    if pack is None:
        return torch.nn.functional.linear(x, weight, bias)
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [], "")
