"""KV gather/scatter kernels vs their torch references, bit for bit.

On a CPU machine the kernels run under the Triton interpreter (set here, before Triton is imported);
on a GPU machine the same tests run compiled on CUDA (marked `cuda`).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "triton_kernels"))

from superinfer_kernels import (  # noqa: E402
    gather_kv_blocks,
    gather_kv_blocks_reference,
    scatter_kv_blocks,
    scatter_kv_blocks_reference,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")),
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA, compiled")],
    ),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

# (layers, kv_heads, head_dim, block_tokens, num_tokens, page_size): odd dims, 1 token, partial tails
CASES = [
    (2, 1, 5, 1, 7, 1),
    (3, 3, 8, 4, 10, 1),
    (2, 2, 64, 16, 37, 16),
    (1, 1, 5, 4, 1, 1),
    (2, 3, 5, 4, 8, 4),
]
POISON = 0xA5


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def random_bits_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, bits(t).shape, dtype=torch.uint8, generator=gen)
    bits(t).copy_(raw.to(t.device))
    return t


def make_pool(layers, heads, dim, dtype, rows, device, gen):
    """Per-layer K/V views into one (2, rows, H, D) allocation per layer, like MHATokenToKVPool."""
    per_layer = [random_bits_(torch.empty((2, rows, heads, dim), dtype=dtype, device=device), gen) for _ in range(layers)]
    k, v = [kv[0] for kv in per_layer], [kv[1] for kv in per_layer]
    k_ptrs = torch.tensor([b.data_ptr() for b in k], dtype=torch.uint64, device=device)
    v_ptrs = torch.tensor([b.data_ptr() for b in v], dtype=torch.uint64, device=device)
    return k, v, k_ptrs, v_ptrs


def make_slots(n, rows, page, gen, device, dtype=torch.int64):
    """n distinct slots in random order; with page > 1, page-aligned runs in random page order."""
    pages = torch.randperm(rows // page, generator=gen)[: math.ceil(n / page)]
    slots = (pages[:, None] * page + torch.arange(page)).flatten()[:n]
    return slots.to(device=device, dtype=dtype)


def make_block_ids(n, block_tokens, num_blocks, gen, device):
    return torch.randperm(num_blocks, generator=gen)[: math.ceil(n / block_tokens)].to(device)


def setup(case, dtype, device, seed=0):
    layers, heads, dim, bt, n, page = case
    gen = torch.Generator().manual_seed(seed)
    rows = 64 + page
    pool = make_pool(layers, heads, dim, dtype, rows, device, gen)
    slots = make_slots(n, rows, page, gen, device)
    num_blocks = math.ceil(n / bt) + 2
    blocks = torch.empty((num_blocks, layers, 2, bt, heads, dim), dtype=dtype, device=device)
    bits(blocks).fill_(POISON)
    ids = make_block_ids(n, bt, num_blocks, gen, device)
    return pool, slots, blocks, ids, (rows, heads, dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gather_matches_reference(case, dtype, device):
    (k, v, kp, vp), slots, dst, ids, shape = setup(case, dtype, device)
    expected = dst.clone()
    gather_kv_blocks_reference(k, v, slots, expected, ids)
    gather_kv_blocks(kp, vp, slots, dst, ids, layer_shape=shape, dtype=dtype, max_programs=3)
    assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_scatter_matches_reference(case, dtype, device):
    (k, v, kp, vp), slots, src, ids, shape = setup(case, dtype, device)
    random_bits_(src, torch.Generator().manual_seed(1))
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    scatter_kv_blocks_reference(k_ref, v_ref, slots, src, ids)
    scatter_kv_blocks(kp, vp, slots, src, ids, layer_shape=shape, dtype=dtype, max_programs=3)
    for got, want in zip(k + v, k_ref + v_ref):
        assert torch.equal(bits(got), bits(want))


# (tile_words, num_warps): tiles narrower than a row (the row is copied in chunks) up to the widest
TUNINGS = [(8, 1), (64, 2), (4096, 4), (16384, 16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tuning", TUNINGS, ids=str)
def test_tunings_copy_the_same_bits(tuning, device):
    tile_words, num_warps = tuning
    (k, v, kp, vp), slots, blocks, ids, shape = setup(CASES[2], torch.bfloat16, device, seed=3)
    expected = blocks.clone()
    gather_kv_blocks_reference(k, v, slots, expected, ids)
    gather_kv_blocks(kp, vp, slots, blocks, ids, layer_shape=shape, dtype=torch.bfloat16, max_programs=2,
                     tile_words=tile_words, num_warps=num_warps)
    assert torch.equal(bits(blocks), bits(expected))
    random_bits_(blocks, torch.Generator().manual_seed(4))
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    scatter_kv_blocks_reference(k_ref, v_ref, slots, blocks, ids)
    scatter_kv_blocks(kp, vp, slots, blocks, ids, layer_shape=shape, dtype=torch.bfloat16, max_programs=2,
                      tile_words=tile_words, num_warps=num_warps)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(k + v, k_ref + v_ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES[1:3], ids=str)
def test_round_trip_is_bit_exact(case, dtype, device):
    (k, v, kp, vp), slots, blocks, ids, shape = setup(case, dtype, device)
    originals = [b.clone() for b in k + v]
    gather_kv_blocks(kp, vp, slots, blocks, ids, layer_shape=shape, dtype=dtype)
    for b in k + v:
        bits(b)[slots.long()] = POISON  # wipe the request's slots only
    scatter_kv_blocks(kp, vp, slots, blocks, ids, layer_shape=shape, dtype=dtype)
    for got, want in zip(k + v, originals):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("device", DEVICES)
def test_reference_semantics_by_hand(device):
    """Pins the contract the references (and so the kernels) implement: token i -> block
    ids[i // block_tokens], row i % block_tokens; rows past the last token stay untouched."""
    case = (2, 1, 3, 4, 6, 1)
    (k, v, kp, vp), slots, dst, ids, shape = setup(case, torch.float32, device)
    gather_kv_blocks(kp, vp, slots, dst, ids, layer_shape=shape, dtype=torch.float32)
    for i, slot in enumerate(slots.tolist()):
        block, row = int(ids[i // 4]), i % 4
        for layer in range(2):
            assert torch.equal(bits(dst[block, layer, 0, row]), bits(k[layer][slot]))
            assert torch.equal(bits(dst[block, layer, 1, row]), bits(v[layer][slot]))
    tail = bits(dst[int(ids[1]), :, :, 2:])
    assert bool((tail == POISON).all())


@pytest.mark.parametrize("device", DEVICES)
def test_int32_indices_and_strided_blocks(device):
    """int32 slot/block ids, and block memory whose block stride is not its block size."""
    case = (2, 2, 8, 4, 9, 1)
    (k, v, kp, vp), slots, dst, ids, shape = setup(case, torch.bfloat16, device)
    wide = torch.empty((dst.shape[0] * 2, *dst.shape[1:]), dtype=dst.dtype, device=device)
    bits(wide).fill_(POISON)
    strided = wide[::2]
    expected = strided.clone()
    gather_kv_blocks_reference(k, v, slots, expected, ids)
    gather_kv_blocks(kp, vp, slots.int(), strided, ids.int(), layer_shape=shape, dtype=torch.bfloat16)
    assert torch.equal(bits(strided), bits(expected))
    assert bool((bits(wide[1::2]) == POISON).all())


@pytest.mark.parametrize("device", DEVICES)
def test_empty_request_is_a_no_op(device):
    (k, v, kp, vp), slots, dst, ids, shape = setup(CASES[1], torch.float16, device)
    before = dst.clone()
    empty = slots[:0]
    gather_kv_blocks(kp, vp, empty, dst, ids[:0], layer_shape=shape, dtype=torch.float16)
    scatter_kv_blocks(kp, vp, empty, dst, ids[:0], layer_shape=shape, dtype=torch.float16)
    assert torch.equal(bits(dst), bits(before))


def _transposed_like(t: torch.Tensor) -> torch.Tensor:
    """Same shape and dtype as t, but heads and head_dim swapped in memory (not contiguous)."""
    return t.new_empty((*t.shape[:4], t.shape[5], t.shape[4])).transpose(4, 5)


BAD_INPUTS = {
    "tile_words not a power of two": lambda a: a.update(tile_words=3000),
    "num_warps 3": lambda a: a.update(num_warps=3),
    "dtype mismatch": lambda a: a.update(dtype=torch.float32),
    "wrong layers": lambda a: a.update(blocks=a["blocks"][:, :1]),
    "wrong heads": lambda a: a.update(layer_shape=(a["layer_shape"][0], 5, a["layer_shape"][2])),
    "5-D block memory": lambda a: a.update(blocks=a["blocks"][0]),
    "non-contiguous block": lambda a: a.update(blocks=_transposed_like(a["blocks"])),
    "float slots": lambda a: a.update(slots=a["slots"].float()),
    "2-D slots": lambda a: a.update(slots=a["slots"][None]),
    "too few block ids": lambda a: a.update(ids=a["ids"][:-1]),
    "block id out of range": lambda a: a.update(ids=a["ids"] + 100),
    "slot out of range": lambda a: a.update(slots=a["slots"] + 10_000),
    "int32 pointer table": lambda a: a.update(k_ptrs=a["k_ptrs"].view(torch.int32)),
    "pointer tables differ in length": lambda a: a.update(v_ptrs=a["v_ptrs"][:1]),
    "slots on another device": lambda a: a.update(slots=a["slots"].to("meta")),
    "bad max_programs": lambda a: a.update(max_programs=0),
    "pool_align not a power of two": lambda a: a.update(pool_align=3),
    "pool pointers less aligned than promised": lambda a: a.update(pool_align=32),  # V sits at 65 * 48 B
}


@pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")
@pytest.mark.parametrize("what", list(BAD_INPUTS))
def test_launchers_reject_bad_input(what):
    (k, v, kp, vp), slots, blocks, ids, shape = setup(CASES[1], torch.float16, "cpu")
    a = dict(k_ptrs=kp, v_ptrs=vp, slots=slots, blocks=blocks, ids=ids, layer_shape=shape,
             dtype=torch.float16, max_programs=None, pool_align=None, tile_words=4096, num_warps=4)
    BAD_INPUTS[what](a)
    for launch in (gather_kv_blocks, scatter_kv_blocks):
        with pytest.raises(ValueError):
            launch(a["k_ptrs"], a["v_ptrs"], a["slots"], a["blocks"], a["ids"], layer_shape=a["layer_shape"],
                   dtype=a["dtype"], max_programs=a["max_programs"], pool_align=a["pool_align"],
                   tile_words=a["tile_words"], num_warps=a["num_warps"])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA, compiled")
def test_cuda_direct_to_pinned_host():
    case = (3, 2, 64, 16, 37, 16)
    (k, v, kp, vp), slots, staging, ids, shape = setup(case, torch.bfloat16, "cuda")
    host = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
    bits(host).fill_(POISON)
    expected = host.clone()
    gather_kv_blocks_reference(k, v, slots, expected, ids)
    gather_kv_blocks(kp, vp, slots, host, ids, layer_shape=shape, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.equal(bits(host), bits(expected))
    for b in k + v:
        bits(b)[slots] = POISON
    k_ref, v_ref = [b.clone() for b in k], [b.clone() for b in v]
    scatter_kv_blocks_reference(k_ref, v_ref, slots, expected, ids)
    scatter_kv_blocks(kp, vp, slots, host, ids, layer_shape=shape, dtype=torch.bfloat16)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(k + v, k_ref + v_ref))


COMPILE_FOR_SM90 = r"""
import collections, re, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from superinfer_kernels.kv_gather import _gather_kv_kernel
from superinfer_kernels.kv_scatter import _scatter_kv_kernel
ints = ["num_tokens", "num_tiles", "num_items", "row_words", "block_stride", "block_tokens"]
for kernel, mem in ((_gather_kv_kernel, "dst"), (_scatter_kv_kernel, "src")):
    names = ["k_ptrs", "v_ptrs", "slots", mem + "_blocks", mem] + ints
    sig = dict(zip(names, ["*i64", "*i64", "*i32", "*i32", "*i64"] + ["i32"] * 6))
    sig.update(BLOCK_T="constexpr", BLOCK_W="constexpr", ROWS_ALIGNED16="constexpr")
    aligned = [["tt.divisibility", 16]]  # what the launcher's specialization gives 16-aligned args
    attrs = {(i,): aligned for i, n in enumerate(names) if n not in ints or n in ("row_words", "block_stride")}
    consts = {"BLOCK_T": 16, "BLOCK_W": 256, "ROWS_ALIGNED16": True}
    ptx = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(kernel.__name__, dict(collections.Counter(re.findall(r"(ld|st)\.global\.v2\.b64", ptx))))
"""


@pytest.mark.skipif(HAS_CUDA, reason="the CUDA tests run the compiled kernels themselves")
def test_kernels_compile_for_sm90_with_16_byte_accesses(tmp_path):
    """The compiled path cannot run here, but it can be built: sm_90 PTX, and with aligned rows the
    pool side (pointer loaded from a table) gets 16-byte loads/stores like the block side."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    kernels_dir = str(Path(__file__).resolve().parents[2] / "triton_kernels")
    out = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90, kernels_dir], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["_gather_kv_kernel", "{'ld':", "16,", "'st':", "16}",
                                  "_scatter_kv_kernel", "{'ld':", "16,", "'st':", "16}"], out.stdout
