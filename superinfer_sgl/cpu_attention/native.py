"""Build (once, with the system C compiler) and call the C paged-decode kernel in csrc/.

Why C: decode attention is memory-bound, and the torch path must copy every request's K/V out
of the pool before it can use BLAS; the kernel reads each K/V row once, in place, straight from
the pool through req_to_token, and keeps the softmax in float32.

Why ctypes and not a torch extension: a plain C file builds in about a second with gcc and needs
no torch headers or ninja. The .so is cached under $SUPERINFER_CACHE_DIR (default
~/.cache/superinfer_sgl)/cpu_attention/, keyed by a hash of the source, the compiler and the
CPU's flags (it is built with -march=native). When no compiler is found or the build fails,
`load()` returns None and callers use the torch path in paged.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_ENTRY = {torch.float32: "superinfer_paged_decode_f32", torch.bfloat16: "superinfer_paged_decode_bf16"}
# The kernel's fixed per-thread buffers (csrc/paged_decode.c MAX_G, MAX_D): wider shapes take the
# torch path (`supports`); the kernel itself returns -2 for them.
MAX_GROUP = 32  # query heads per KV head
MAX_HEAD_DIM = 256  # of K and of V
_ERRORS = {-1: "query heads not a multiple of KV heads", -2: "group or head_dim too large", -3: "bad seq_lens or out of memory"}


class NativeKernelError(RuntimeError):
    """The C kernel rejected its inputs."""


def _cache_dir() -> Path:
    root = os.environ.get("SUPERINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "superinfer_sgl")
    return Path(root) / "cpu_attention"


def _writable_cache_dir() -> Path:
    """The cache folder, or one under the temp dir where it cannot be created or written (a
    read-only home): the kernel is then built once per machine boot instead of not at all."""
    for where in (_cache_dir(), Path(tempfile.gettempdir()) / f"superinfer_sgl-{os.getuid()}" / "cpu_attention"):
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(where, os.W_OK | os.X_OK):
            return where
    raise OSError(f"no writable folder for the compiled kernel (tried {_cache_dir()} and the temp dir)")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:  # no /proc/cpuinfo (not Linux): the key then leaves the CPU out
        return ""
    return ""


def _build_key(compiler: list[str], source: Path = SOURCE, cflags: tuple[str, ...] = CFLAGS) -> str:
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=False).stdout
    h = hashlib.sha256()
    headers = [p.read_bytes().decode() for p in sorted(source.parent.glob("*.h"))]  # e.g. bf16.h
    for part in (source.read_bytes().decode(), *headers, " ".join(cflags), version, _cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _build(compiler: list[str], target: Path, source: Path = SOURCE, cflags: tuple[str, ...] = CFLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build to a private name, then rename: concurrent builders (TP ranks) never see a partial file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        cmd = [*compiler, *cflags, "-o", str(partial), str(source), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
        if proc.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    for name in _ENTRY.values():
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [
            ptr, i64, i64,  # q, q_sb, q_sh
            ptr, ptr, i64, i64,  # k_cache, v_cache, kv_ss, kv_sh
            ptr, i64,  # req_to_token, r2t_s
            ptr, ptr,  # req_pool_indices, seq_lens
            ptr, i64, i64,  # out, o_sb, o_sh
            i32, i32, i32, i32, i32,  # B, Hq, Hkv, D, Dv
            f32, i32, i32,  # scale, max_len, num_threads
        ]


def _compiler() -> list[str] | None:
    """The C compiler's command: $CC (split: it may carry a launcher or flags, "ccache gcc"), else gcc or cc."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    return shlex.split(cc) if cc and cc.strip() else None


def cached_library(compiler: list[str], source: Path = SOURCE, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Where the library built from `source` with `cflags` by `compiler` is cached."""
    return _writable_cache_dir() / f"{source.stem}-{_build_key(compiler, source, cflags)}.so"


def build_and_load(source: Path, cflags: tuple[str, ...], declare, what: str) -> ctypes.CDLL | None:
    """Compile `source` (cached by content, flags, compiler and CPU), load it, declare its
    entry points; None (with a warning naming `what` falls back) if any step fails."""
    compiler = _compiler()
    if compiler is None:
        logger.warning("superinfer cpu: no C compiler found; using %s", what)
        return None
    try:
        target = cached_library(compiler, source, cflags)
        if not target.exists():
            _build(compiler, target, source, cflags)
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as exc:  # a cached file that does not load (truncated, foreign): rebuilt once
            logger.warning("superinfer cpu: cached %s does not load (%s); rebuilding it", target.name, exc)
            target.unlink(missing_ok=True)
            _build(compiler, target, source, cflags)
            lib = ctypes.CDLL(str(target))
        declare(lib)
        return lib
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("superinfer cpu: %s unavailable (%s); using %s", source.name, exc, what)
        return None


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None if it cannot be built."""
    return build_and_load(SOURCE, CFLAGS, _declare, "the torch decode path")


def shape_supported(q_heads: int, kv_heads: int, head_dim: int, v_head_dim: int) -> bool:
    """Whether the kernel serves this attention shape (its per-thread buffers: MAX_GROUP, MAX_HEAD_DIM)."""
    return (kv_heads > 0 and q_heads % kv_heads == 0 and q_heads // kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM and v_head_dim <= MAX_HEAD_DIM)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these tensors (q: [B, Hq, D], the pools: [slots, Hkv, D / Dv])."""
    return (
        q.device.type == "cpu"
        and q.dtype in SUPPORTED_DTYPES
        and k_cache.dtype == q.dtype == v_cache.dtype
        and k_cache.stride()[:2] == v_cache.stride()[:2]  # the kernel walks both pools with K's strides
        and shape_supported(q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[2])
        and load() is not None
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Same contract as paged.decode_attention, reading slots from req_to_token directly.

    req_pool_indices and seq_lens must be int64 and contiguous; req_to_token int32 with
    contiguous rows; max_len >= max(seq_lens) and <= req_to_token.shape[1].
    """
    lib = load()
    assert lib is not None, "native kernel not available: check supports() first"
    batch, hq, dim = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and q.dtype in SUPPORTED_DTYPES
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert k_cache.stride()[:2] == v_cache.stride()[:2], "K and V pools must share strides"
    assert out.shape == (batch, hq, dv) and k_cache.shape[2] == dim
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    assert max_len <= req_to_token.shape[1]
    assert req_pool_indices.dtype == torch.int64 and req_pool_indices.is_contiguous()
    assert seq_lens.dtype == torch.int64 and seq_lens.is_contiguous()
    assert req_pool_indices.shape == (batch,) and seq_lens.shape == (batch,)
    if batch == 0:
        return out
    rc = getattr(lib, _ENTRY[q.dtype])(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        req_to_token.data_ptr(), req_to_token.stride(0),
        req_pool_indices.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        batch, hq, hkv, dim, dv,
        scale, max_len, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise NativeKernelError(f"paged decode kernel failed ({rc}: {_ERRORS.get(rc, 'unknown')})")
    return out
