"""Per-layer CPU ops in C (csrc/cpu_ops.c): RMSNorm (+ residual add), rotary embedding, SiLU-and-mul.

At decode batch sizes SGLang's torch forward_native versions of these are 6-15 tiny torch ops
each (every one a dispatcher round trip and an allocation), 15-20% of a SmolLM2 decode step on
one core; one ctypes call does each. Built like the decode kernel (native.build_and_load), with
-ffp-contract=off so every step rounds like the torch op it replaces. Callers check `supports_*`
and fall back to SGLang's own code otherwise (no compiler, other dtypes, odd strides).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.c"
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11")
DTYPES = (torch.float32, torch.bfloat16)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_HIDDEN = 16384  # MAX_H in cpu_ops.c


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    for sfx in _SUFFIX.values():
        fn = getattr(lib, f"superinfer_rmsnorm_{sfx}")
        fn.restype = i32
        fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i32, i32, f32, i32]
        fn = getattr(lib, f"superinfer_rope_{sfx}")
        fn.restype = i32
        fn.argtypes = [ptr, ptr, i64, ptr, i64, i32, i32, i32, i32, ptr, i64, i64, i32]
        fn = getattr(lib, f"superinfer_silu_mul_{sfx}")
        fn.restype = i32
        fn.argtypes = [ptr, i64, ptr, i64, i32, i32]


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    return native.build_and_load(SOURCE, CFLAGS, _declare, "SGLang's torch ops")


def _rows_ok(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


def supports_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 1
        and weight.is_contiguous()
        and x.dim() == 2
        and x.shape[-1] == weight.shape[0] <= MAX_HIDDEN
        and _rows_ok(x)
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape and _rows_ok(residual)))
        and not torch.is_grad_enabled()
        and load() is not None
    )


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    cast_before_mul: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward_native(x, residual) for 2-D x: (out, x + residual) or out."""
    lib = load()
    assert lib is not None
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=x.dtype)
    res_out = torch.empty((tokens, hidden), dtype=x.dtype) if residual is not None else None
    rc = getattr(lib, f"superinfer_rmsnorm_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0),
        residual.data_ptr() if residual is not None else None, residual.stride(0) if residual is not None else 0,
        weight.data_ptr(), out.data_ptr(), out.stride(0),
        res_out.data_ptr() if res_out is not None else None, res_out.stride(0) if res_out is not None else 0,
        tokens, hidden, float(eps), int(cast_before_mul),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"superinfer rmsnorm kernel failed ({rc})")
    return out if res_out is None else (out, res_out)


def supports_rope(positions: torch.Tensor, x: torch.Tensor, head_size: int, rot_dim: int, cache: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and cache.dtype == x.dtype
        and cache.dim() == 2
        and cache.stride(1) == 1
        and cache.shape[1] == rot_dim
        and rot_dim % 2 == 0
        and 0 < rot_dim <= head_size
        and positions.dtype == torch.int64
        and positions.dim() == 1
        and positions.is_contiguous()
        and x.dim() == 2
        and x.shape[0] == positions.shape[0]
        and x.shape[1] % head_size == 0
        and x.stride(1) == 1
        and not torch.is_grad_enabled()
        and load() is not None
    )


def rope(positions: torch.Tensor, x: torch.Tensor, head_size: int, rot_dim: int, cache: torch.Tensor, neox: bool) -> torch.Tensor:
    """apply_rotary_emb over all heads of x [T, heads * head_size] (dims past rot_dim copied),
    into a new contiguous tensor of x's shape. Positions outside the cache raise."""
    lib = load()
    assert lib is not None
    tokens = x.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = getattr(lib, f"superinfer_rope_{_SUFFIX[x.dtype]}")(
        positions.data_ptr(), x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
        tokens, x.shape[1] // head_size, head_size, rot_dim,
        cache.data_ptr(), cache.stride(0), cache.shape[0], int(neox),
    )  # fmt: skip
    if rc != 0:
        raise IndexError("rotary position outside the cos/sin cache")
    return out


def supports_silu_mul(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and x.dim() == 2
        and x.shape[1] % 2 == 0
        and x.shape[1] > 0
        and x.stride(1) == 1
        and not torch.is_grad_enabled()
        and load() is not None
    )


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SiluAndMul.forward_native for 2-D x [T, 2d]: silu(x[:, :d]) * x[:, d:] as a new [T, d]."""
    lib = load()
    assert lib is not None
    tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, d), dtype=x.dtype)
    rc = getattr(lib, f"superinfer_silu_mul_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), tokens, d
    )
    if rc != 0:
        raise RuntimeError(f"superinfer silu_mul kernel failed ({rc})")
    return out
