"""CPU compatibility: a torch rotary-embedding fallback for SGLang's CPU path.

Without CUDA (and without SGLANG_USE_CPU_ENGINE's sgl_kernel CPU build), RotaryEmbedding.__init__
does `from vllm._custom_ops import rotary_embedding`, so even stock SGLang cannot serve on a CPU.
This patch makes that one import resolve to the torch implementation below, only while the
constructor runs and only when vLLM itself is not installed.

Switch: SUPERINFER_CPU_COMPAT=1 enables it in any SGLang process where our package is installed
(including stock `python -m sglang.launch_server`); our launcher sets it by default on CPU.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, Callable

import torch

from . import check_target

TARGET = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init__"
_SHIM_NAME = "vllm._custom_ops"


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """In-place RoPE with vLLM's `rotary_embedding` signature and semantics.

    cos_sin_cache is [max_pos, rot_dim] holding cos then sin halves; query/key are
    [tokens, heads * head_size] (views into the fused qkv tensor are fine: only the last dim
    needs to be contiguous).
    """
    pos = positions.flatten()
    cos, sin = cos_sin_cache.index_select(0, pos).chunk(2, dim=-1)
    half = cos.shape[-1]
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(pos.shape[0], -1, head_size)[..., : 2 * half]
        c = cos.unsqueeze(1).to(x.dtype)
        s = sin.unsqueeze(1).to(x.dtype)
        if is_neox:
            x1, x2 = heads[..., :half], heads[..., half:]
        else:
            x1, x2 = heads[..., 0::2], heads[..., 1::2]
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        x1.copy_(o1)
        x2.copy_(o2)


def _shim_module() -> types.ModuleType:
    mod = types.ModuleType(_SHIM_NAME)
    mod.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    mod.__superinfer_shim__ = True  # type: ignore[attr-defined]
    return mod


def _vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _around_init(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Scope the shim to the constructor: nothing else ever sees a fake vllm module.
    if _vllm_available() or _SHIM_NAME in sys.modules:
        return original(*args, **kwargs)
    sys.modules[_SHIM_NAME] = _shim_module()
    try:
        return original(*args, **kwargs)
    finally:
        sys.modules.pop(_SHIM_NAME, None)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _around_init, HookType.AROUND)
