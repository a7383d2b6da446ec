"""The KV transfer benchmark's rig and its block-size, SM and tuning sweeps.

The methods measured (bytes per direction are KV payload bytes: tokens x layers x 2 x kv_heads x
head_dim x element size):
  memcpy-ceiling   one large pinned copy per direction: the bandwidth ceiling (a reference)
  naive, triton-dma, triton-dma-serial, triton-hybrid, triton-direct
                   the rotation engine's own transfer path objects (duplexkv/transfer.py: make_path),
                   called exactly as RotationEngine calls them, on a host pool of the engine's own
                   layout; triton-dma is the pipelined staging ring (with the rig's ring options),
                   triton-dma-serial its unpipelined form, triton-hybrid the duplex alternative
  hicache-like (torch re-creation)
                   SGLang HiCache's pattern re-created in torch (sgl_kernel needs SGLang): per layer
                   and K/V, an index gather/scatter on the device plus one copy to or from a
                   layer-first host pool; one call per block (a reference)
`out` moves tokens [0, n) into host blocks [0, nb); `in` moves the second half back, so both
directions can run at once on their own streams.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..duplexkv.device_pool import DevicePoolView
from ..duplexkv.host_pool import HostKVPool
from ..duplexkv.transfer import make_path

HICACHE = "hicache-like (torch re-creation)"
ENGINE_PATHS = ("naive", "triton-dma", "triton-dma-serial", "triton-hybrid", "triton-direct")
METHODS = ["memcpy-ceiling", *ENGINE_PATHS, HICACHE]
KERNEL_METHODS = {"triton-dma", "triton-dma-serial", "triton-hybrid", "triton-direct"}
MB = 2**20


@dataclass(frozen=True)
class Shape:
    """Model-shaped KV geometry of the benchmark."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_layers: int

    @property
    def row_bytes(self) -> int:  # one token, one layer, K or V
        return self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def split(self, block_bytes: int) -> tuple[int, int]:
        """(layers, block_tokens) whose block is block_bytes: as many layers as the model has first."""
        layers = max(1, min(self.max_layers, block_bytes // (2 * self.row_bytes)))
        return layers, max(1, block_bytes // (2 * layers * self.row_bytes))


@dataclass(frozen=True)
class Config:
    device: torch.device
    shape: Shape
    block_sizes: list[int]
    volume: int  # bytes per direction per measurement
    iters: int
    max_sms: int
    max_copy_ops: int  # caps per-piece methods so one run stays short
    methods: list[str]
    rotation: dict
    ring: dict = field(default_factory=dict)  # staging ring options of the ring paths (default: the engine's)


@dataclass
class Rig:
    """Device pool, the engine's block-first host pool, device staging for the ceiling and a
    layer-first host pool for the HiCache-like reference, sized for two disjoint halves."""

    pool: DevicePoolView
    host: HostKVPool  # 2 nb blocks of [layers, 2, bt, H, D]
    staging: torch.Tensor  # host.data's shape, on the device
    layer_first: torch.Tensor  # [2 (K/V), layers, 2 n, H, D]: HiCache's layer_first layout
    layers: int
    block_tokens: int
    tokens: int  # n, per direction
    max_sms: int
    tuning: dict = field(default_factory=dict)  # tile_words / num_warps for the kernels (default: theirs)
    ring: dict = field(default_factory=dict)  # ring_slots / ring_slot_bytes of the ring paths (default: theirs)
    paths: dict = field(default_factory=dict)  # the engine's path objects, built on first use per ring

    @property
    def token_bytes(self) -> int:
        return self.pool.bytes_per_token

    def path(self, method: str):  # type: ignore[no-untyped-def]
        key = (method, tuple(sorted(self.ring.items())))
        if key not in self.paths:
            self.paths[key] = make_path(method, self.pool, self.host, self.max_sms, **self.ring)
        p = self.paths[key]
        if method in KERNEL_METHODS:
            p.launch = dict(layer_shape=self.pool.layer_shape, dtype=self.pool.dtype, max_programs=self.max_sms,
                            **self.tuning)
        return p


def build_rig(cfg: Config, block_bytes: int) -> Rig:
    sh = cfg.shape
    layers, bt = sh.split(block_bytes)
    blocks = max(1, cfg.volume // (layers * 2 * bt * sh.row_bytes))
    n = blocks * bt
    pool = DevicePoolView.synthetic(2 * n, layers, sh.kv_heads, sh.head_dim, sh.dtype, cfg.device)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.view(torch.uint8).random_(0, 256)
    host = HostKVPool(2 * blocks, layers, sh.kv_heads, sh.head_dim, bt, sh.dtype, pin=cfg.device.type == "cuda")
    pin = host.pinned
    return Rig(
        pool=pool, host=host,
        staging=torch.empty(host.data.shape, dtype=sh.dtype, device=cfg.device),
        layer_first=torch.empty((2, layers, 2 * n, sh.kv_heads, sh.head_dim), dtype=sh.dtype, pin_memory=pin),
        layers=layers, block_tokens=bt, tokens=n, max_sms=cfg.max_sms, ring=dict(cfg.ring),
    )


# ---- methods: generators that enqueue one operation per step, so two directions interleave
def _half(rig: Rig, direction: str, tokens: int) -> tuple[int, int, int]:
    """(first slot, first block, block count) of the half a direction uses."""
    nb = math.ceil(tokens / rig.block_tokens)
    if direction == "out":
        return 0, 0, nb
    return rig.tokens, rig.host.num_blocks // 2, nb


def ceiling(rig: Rig, direction: str, tokens: int) -> Iterator[None]:
    _, b0, nb = _half(rig, direction, tokens)
    host = rig.host.data
    if direction == "out":
        host[b0 : b0 + nb].copy_(rig.staging[b0 : b0 + nb], non_blocking=True)
    else:
        rig.staging[b0 : b0 + nb].copy_(host[b0 : b0 + nb], non_blocking=True)
    yield


def engine_path(method: str) -> Callable[[Rig, str, int], Iterator[None]]:
    """The engine's own transfer path `method`, as RotationEngine calls it (slots on the device)."""
    def run(rig: Rig, direction: str, tokens: int) -> Iterator[None]:
        s0, b0, nb = _half(rig, direction, tokens)
        slots = torch.arange(s0, s0 + tokens, device=rig.pool.device)
        blocks = list(range(b0, b0 + nb))
        path = rig.path(method)
        path.to_host(slots, blocks) if direction == "out" else path.to_device(blocks, slots)
        yield

    return run


def hicache_like(rig: Rig, direction: str, tokens: int) -> Iterator[None]:
    """Per block (one call), per layer and K/V: index gather/scatter on the device + one host copy."""
    s0, _, nb = _half(rig, direction, tokens)
    bt = rig.block_tokens
    for j in range(nb):
        idx = torch.arange(s0 + j * bt, s0 + (j + 1) * bt, device=rig.pool.device)
        host_rows = slice(s0 + j * bt, s0 + (j + 1) * bt)
        for layer in range(rig.layers):
            for kv, bufs in enumerate((rig.pool.k_buffers, rig.pool.v_buffers)):
                host = rig.layer_first[kv, layer, host_rows]
                if direction == "out":
                    host.copy_(bufs[layer].index_select(0, idx), non_blocking=True)
                else:
                    bufs[layer].index_copy_(0, idx, host.to(rig.pool.device, non_blocking=True))
                yield


MethodFn = Callable[[Rig, str, int], Iterator[None]]
IMPLS: dict[str, MethodFn] = {"memcpy-ceiling": ceiling, HICACHE: hicache_like,
                              **{m: engine_path(m) for m in ENGINE_PATHS}}


def ops_per_block(method: str, layers: int) -> int:
    """Copies per block of the per-piece methods; 0 for the batched ones."""
    return 2 * layers if method in ("naive", HICACHE) else 0


def ops_per_direction(method: str, blocks: int, layers: int, slot_blocks: int = 0) -> int:
    """Copies or launches issued per direction (HiCache-like also runs an index op per copy; the ring
    paths a launch and a copy per chunk of slot_blocks blocks, the hybrid's out one launch)."""
    if method in ("triton-dma", "triton-hybrid") and slot_blocks:
        return 2 * -(-blocks // slot_blocks)
    batched = {"memcpy-ceiling": 1, "triton-direct": 1, "triton-dma-serial": 2}
    return batched.get(method, blocks * ops_per_block(method, layers))


# ---- timing
class Streams:
    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.out = torch.cuda.Stream(device) if cuda else None
        self.into = torch.cuda.Stream(device) if cuda else None
        self.device = device

    def on(self, stream):  # type: ignore[no-untyped-def]
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def drain(streams: Streams, jobs: list[tuple[object, Iterator[None]]]) -> None:
    """Issue the jobs' operations round-robin, each on its own stream."""
    done = object()
    active = list(jobs)
    while active:
        for job in list(active):
            with streams.on(job[0]):
                if next(job[1], done) is done:
                    active.remove(job)


def median_seconds(streams: Streams, run: Callable[[], None], iters: int) -> float:
    run()  # warm-up: kernel compilation, allocator
    streams.sync()
    times = []
    for _ in range(iters):
        streams.sync()
        t0 = time.perf_counter()
        run()
        streams.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(cfg: Config, streams: Streams, rig: Rig, method: str, directions: tuple[str, ...], tokens: int) -> float:
    impl = IMPLS[method]
    stream_of = {"out": streams.out, "in": streams.into}

    def run() -> None:
        drain(streams, [(stream_of[d], impl(rig, d, tokens)) for d in directions])

    return median_seconds(streams, run, cfg.iters)


def tokens_for(cfg: Config, rig: Rig, method: str) -> int:
    per_block = ops_per_block(method, rig.layers)
    if not per_block:
        return rig.tokens
    blocks = max(1, min(rig.tokens // rig.block_tokens, cfg.max_copy_ops // per_block))
    return blocks * rig.block_tokens
