#!/usr/bin/env python3
"""KV transfer benchmark for DuplexKV: GB/s and latency of moving KV between the device pool and host.

Needs only torch + triton (no SGLang), so it runs on the GPU machine; the GPU numbers we report come
from that machine (its device name is recorded in the JSON). One call does everything:

  1. Block-size sweep (64 KB .. 16 MB per block; a block = block_tokens x layers x {K,V}), one way
     (out = device->host, in = host->device) and both ways at once on two streams, for:
       memcpy-ceiling   one large pinned copy per direction, the bandwidth ceiling
       naive            one copy per page (block_tokens tokens) per layer per K/V, as stock swap does
       triton-dma       one gather/scatter launch to device staging + one DMA per direction
       triton-direct    one gather/scatter launch reading/writing pinned host memory directly
       hicache-like (torch re-creation)
                        SGLang HiCache's pattern re-created in torch (sgl_kernel needs SGLang):
                        per layer and K/V, an index gather/scatter on the device plus one copy to or
                        from a layer-first host pool; one call per block, so its pieces are
                        block_bytes / (2 * layers)
     Kernel paths run a persistent grid capped at --max-sms programs; the JSON records the count.
  2. SM sweep: both kernel paths at one block size with 1..all programs.
  2b. Segment sweep: back-to-back copies of one contiguous segment size each (4 KB .. 16 MB), one way
     and both ways at once: the per-copy points of the simulator's link model (sim/profile.py);
     issued from Python (as our naive path does) and from a captured CUDA graph (as a C++ loop would).
  2c. Tuning sweep: both kernel paths at --max-sms programs for several tile sizes and warp counts.
  3. One rotation of a Llama-3-8B-shaped request (32 layers, 8 KV heads, head_dim 128, bf16, 4096
     tokens = 512 MiB) out and back in through RotationEngine, checked bit-exact.
Bytes per direction are KV payload bytes: tokens x layers x 2 x kv_heads x head_dim x element size.

Writes --out (JSON) and a PNG of GB/s vs block size next to it (matplotlib if installed; else
re-plot later with --plot-from). Without CUDA, --cpu-smoke runs tiny sizes on CPU: copy paths only,
plus the Triton paths when TRITON_INTERPRET=1 is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "triton_kernels")]

from superinfer_sgl.duplexkv import DevicePoolView, HostKVPool, RotationEngine  # noqa: E402

HICACHE = "hicache-like (torch re-creation)"
METHODS = ["memcpy-ceiling", "naive", "triton-dma", "triton-direct", HICACHE]
KERNEL_METHODS = {"triton-dma", "triton-direct"}
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


def config_from_args(args: argparse.Namespace) -> Config:
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        raise SystemExit("no CUDA device: run with --cpu-smoke")
    methods = [m for m in METHODS if m not in KERNEL_METHODS or cuda or os.environ.get("TRITON_INTERPRET") == "1"]
    if cuda:
        return Config(
            device=torch.device("cuda"),
            shape=Shape(8, 128, torch.bfloat16, 32),
            block_sizes=[64 * 2**10, 256 * 2**10, MB, 4 * MB, 16 * MB],
            volume=int(args.gib * 2**30),
            iters=args.iters,
            max_sms=args.max_sms,
            max_copy_ops=16384,
            methods=methods,
            rotation=dict(layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, tokens=4096, block_tokens=16),
        )
    return Config(
        device=torch.device("cpu"),
        shape=Shape(2, 16, torch.float16, 4),
        block_sizes=[2**10, 4 * 2**10, 16 * 2**10],
        volume=64 * 2**10,
        iters=2,
        max_sms=args.max_sms,
        max_copy_ops=256,
        methods=methods,
        rotation=dict(layers=2, kv_heads=2, head_dim=16, dtype=torch.float16, tokens=64, block_tokens=4),
    )


# ---------------------------------------------------------------- buffers for one block size


@dataclass
class Rig:
    """Device pool, block-first pinned host memory, device staging and a layer-first host pool, all
    sized for two disjoint halves: `out` moves tokens [0, n) and blocks [0, nb); `in` the second half."""

    pool: DevicePoolView
    host: torch.Tensor  # [2 nb, layers, 2, bt, H, D], pinned
    staging: torch.Tensor  # same shape, on the device
    layer_first: torch.Tensor  # [2 (K/V), layers, 2 n, H, D], pinned: HiCache's layer_first layout
    layers: int
    block_tokens: int
    tokens: int  # n, per direction
    max_sms: int
    tuning: dict = field(default_factory=dict)  # tile_words / num_warps for the kernels (default: theirs)

    @property
    def token_bytes(self) -> int:
        return self.pool.bytes_per_token


def build_rig(cfg: Config, block_bytes: int) -> Rig:
    sh = cfg.shape
    layers, bt = sh.split(block_bytes)
    blocks = max(1, cfg.volume // (layers * 2 * bt * sh.row_bytes))
    n = blocks * bt
    pin = cfg.device.type == "cuda"
    pool = DevicePoolView.synthetic(2 * n, layers, sh.kv_heads, sh.head_dim, sh.dtype, cfg.device)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.view(torch.uint8).random_(0, 256)
    host_shape = (2 * blocks, layers, 2, bt, sh.kv_heads, sh.head_dim)
    return Rig(
        pool=pool,
        host=torch.empty(host_shape, dtype=sh.dtype, pin_memory=pin),
        staging=torch.empty(host_shape, dtype=sh.dtype, device=cfg.device),
        layer_first=torch.empty((2, layers, 2 * n, sh.kv_heads, sh.head_dim), dtype=sh.dtype, pin_memory=pin),
        layers=layers,
        block_tokens=bt,
        tokens=n,
        max_sms=cfg.max_sms,
    )


# ---------------------------------------------------------------- transfer methods
# Each method is a generator that enqueues one operation per step, so that the two directions can be
# issued interleaved on their own streams (both-ways runs) and one way is just draining it.


def _half(rig: Rig, direction: str, tokens: int) -> tuple[int, int, int]:
    """(first slot, first block, block count) of the half a direction uses."""
    nb = math.ceil(tokens / rig.block_tokens)
    if direction == "out":
        return 0, 0, nb
    return rig.tokens, rig.host.shape[0] // 2, nb


def ceiling(rig: Rig, direction: str, tokens: int) -> Iterator[None]:
    _, b0, nb = _half(rig, direction, tokens)
    if direction == "out":
        rig.host[b0 : b0 + nb].copy_(rig.staging[b0 : b0 + nb], non_blocking=True)
    else:
        rig.staging[b0 : b0 + nb].copy_(rig.host[b0 : b0 + nb], non_blocking=True)
    yield


def naive(rig: Rig, direction: str, tokens: int) -> Iterator[None]:
    s0, b0, nb = _half(rig, direction, tokens)
    bt = rig.block_tokens
    for j in range(nb):
        s = s0 + j * bt
        for layer in range(rig.layers):
            for kv, bufs in enumerate((rig.pool.k_buffers, rig.pool.v_buffers)):
                dev, host = bufs[layer][s : s + bt], rig.host[b0 + j, layer, kv]
                (host.copy_(dev, non_blocking=True) if direction == "out" else dev.copy_(host, non_blocking=True))
                yield


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


def _kernels():
    import superinfer_kernels

    return superinfer_kernels


def _launch(rig: Rig, direction: str, tokens: int, blocks_mem: torch.Tensor, b0: int, programs: int) -> None:
    s0, _, nb = _half(rig, direction, tokens)
    dev = rig.pool.device
    slots = torch.arange(s0, s0 + tokens, device=dev)
    ids = torch.arange(b0, b0 + nb, device=dev)
    fn = _kernels().gather_kv_blocks if direction == "out" else _kernels().scatter_kv_blocks
    p = rig.pool
    fn(p.k_ptrs, p.v_ptrs, slots, blocks_mem, ids, layer_shape=p.layer_shape, dtype=p.dtype, max_programs=programs,
       **rig.tuning)


def triton_direct(rig: Rig, direction: str, tokens: int) -> Iterator[None]:
    _, b0, _ = _half(rig, direction, tokens)
    _launch(rig, direction, tokens, rig.host, b0, rig.max_sms)
    yield


def triton_dma(rig: Rig, direction: str, tokens: int) -> Iterator[None]:
    _, b0, nb = _half(rig, direction, tokens)
    if direction == "in":
        rig.staging[b0 : b0 + nb].copy_(rig.host[b0 : b0 + nb], non_blocking=True)
        yield
    _launch(rig, direction, tokens, rig.staging, b0, rig.max_sms)
    yield
    if direction == "out":
        rig.host[b0 : b0 + nb].copy_(rig.staging[b0 : b0 + nb], non_blocking=True)
        yield


MethodFn = Callable[[Rig, str, int], Iterator[None]]
IMPLS: dict[str, MethodFn] = {
    "memcpy-ceiling": ceiling,
    "naive": naive,
    "triton-dma": triton_dma,
    "triton-direct": triton_direct,
    HICACHE: hicache_like,
}


def ops_per_block(method: str, layers: int) -> int:
    """Copies per block of the per-piece methods; 0 for the batched ones."""
    return 2 * layers if method in ("naive", HICACHE) else 0


def ops_per_direction(method: str, blocks: int, layers: int) -> int:
    """Copies or launches issued per direction (HiCache-like also runs an index op per copy)."""
    batched = {"memcpy-ceiling": 1, "triton-direct": 1, "triton-dma": 2}
    return batched.get(method, blocks * ops_per_block(method, layers))


# ---------------------------------------------------------------- timing


class Streams:
    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.out = torch.cuda.Stream(device) if cuda else None
        self.into = torch.cuda.Stream(device) if cuda else None
        self.device = device

    def on(self, stream):
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


def sweep_rows(cfg: Config, streams: Streams, rig: Rig, block_bytes: int, method: str) -> list[dict]:
    tokens = tokens_for(cfg, rig, method)
    nbytes = tokens * rig.token_bytes
    blocks = tokens // rig.block_tokens
    base = dict(
        method=method,
        block_bytes=block_bytes,
        layers=rig.layers,
        block_tokens=rig.block_tokens,
        piece_bytes=rig.block_tokens * cfg.shape.row_bytes if ops_per_block(method, rig.layers) else block_bytes,
        bytes_per_direction=nbytes,
        programs=rig.max_sms if method in KERNEL_METHODS else 0,
        ops_per_direction=ops_per_direction(method, blocks, rig.layers),
    )
    rows = []
    for directions in (("out",), ("in",), ("out", "in")):
        seconds = measure(cfg, streams, rig, method, directions, tokens)
        label = directions[0] if len(directions) == 1 else "both"
        rows.append({**base, "direction": label, "seconds": seconds, "gbps_per_direction": nbytes / seconds / 1e9})
    one_block = measure(cfg, streams, rig, method, ("out",), rig.block_tokens)
    rows.append({**base, "direction": "out-one-block", "bytes_per_direction": rig.block_tokens * rig.token_bytes,
                 "seconds": one_block, "latency_us": one_block * 1e6})
    return rows


def run_sweep(cfg: Config, streams: Streams) -> list[dict]:
    rows: list[dict] = []
    for block_bytes in cfg.block_sizes:
        rig = build_rig(cfg, block_bytes)
        for method in cfg.methods:
            one = lambda: sweep_rows(cfg, streams, rig, block_bytes, method)  # noqa: E731
            rows.extend(guarded(one, method=method, block_bytes=block_bytes))
        del rig
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_sm_sweep(cfg: Config, streams: Streams) -> list[dict]:
    if cfg.device.type != "cuda":
        return []
    block_bytes = 4 * MB
    rig = build_rig(cfg, block_bytes)
    sms = torch.cuda.get_device_properties(cfg.device).multi_processor_count
    rows = []
    for programs in sorted({1, 2, 4, 8, 16, 32, 64, sms} & set(range(1, sms + 1))):
        rig.max_sms = programs
        for method in ("triton-direct", "triton-dma"):
            for direction in ("out", "in"):
                def one(method=method, direction=direction, programs=programs):
                    s = measure(cfg, streams, rig, method, (direction,), rig.tokens)
                    return [dict(method=method, direction=direction, programs=programs, block_bytes=block_bytes,
                                 seconds=s, gbps=rig.tokens * rig.token_bytes / s / 1e9)]
                rows.extend(guarded(one, method=method, programs=programs))
    return rows


TUNINGS = [(4096, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16)]  # (tile_words, num_warps)


def run_tuning_sweep(cfg: Config, streams: Streams) -> list[dict]:
    """Both kernel paths at --max-sms programs, 4 MB blocks, for several tile sizes and warp counts:
    bytes in flight per program is what a capped grid needs to hide latency."""
    if cfg.device.type != "cuda":
        return []
    rig = build_rig(cfg, 4 * MB)
    rows = []
    for tile_words, num_warps in TUNINGS:
        rig.tuning = dict(tile_words=tile_words, num_warps=num_warps)
        for method in ("triton-direct", "triton-dma"):
            for directions in (("out",), ("in",), ("out", "in")):
                def one(method=method, directions=directions):
                    s = measure(cfg, streams, rig, method, directions, rig.tokens)
                    label = directions[0] if len(directions) == 1 else "both"
                    return [dict(method=method, direction=label, programs=rig.max_sms, tile_words=tile_words,
                                 num_warps=num_warps, seconds=s, gbps_per_direction=rig.tokens * rig.token_bytes / s / 1e9)]
                rows.extend(guarded(one, method=method, tile_words=tile_words, num_warps=num_warps))
    rig.tuning = {}
    return rows


SEGMENT_SIZES_GPU = [4 * 2**10, 16 * 2**10, 32 * 2**10, 64 * 2**10, 256 * 2**10, MB, 4 * MB, 8 * MB, 16 * MB]


def segment_buffers(cfg: Config, volume: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random device and host bytes per direction (pinned on CUDA), so both directions can run at once."""
    cuda = cfg.device.type == "cuda"
    dev = {d: torch.empty(volume, dtype=torch.uint8, device=cfg.device).random_(0, 256) for d in ("out", "in")}
    host = {d: torch.empty(volume, dtype=torch.uint8, pin_memory=cuda).random_(0, 256) for d in ("out", "in")}
    return dev, host


def run_segment_sweep(cfg: Config, streams: Streams) -> list[dict]:
    """GB/s of back-to-back copies of one segment size (one cudaMemcpyAsync each) between a device
    buffer and pinned host memory; each direction has its own buffers so both can run at once."""
    cuda = cfg.device.type == "cuda"
    sizes = SEGMENT_SIZES_GPU if cuda else [2**10, 4 * 2**10]
    volume = min(cfg.volume, 256 * MB) if cuda else cfg.volume
    dev, host = segment_buffers(cfg, volume)
    stream_of = {"out": streams.out, "in": streams.into}
    rows = []
    for seg in sizes:
        count = max(1, min(volume // seg, cfg.max_copy_ops))

        def copies(direction: str) -> Iterator[None]:
            for i in range(count):
                d, h = dev[direction][i * seg : (i + 1) * seg], host[direction][i * seg : (i + 1) * seg]
                (h.copy_(d, non_blocking=True) if direction == "out" else d.copy_(h, non_blocking=True))
                yield

        for directions in (("out",), ("in",), ("out", "in")):
            def one(directions=directions) -> list[dict]:
                run = lambda: drain(streams, [(stream_of[d], copies(d)) for d in directions])  # noqa: E731
                s = median_seconds(streams, run, cfg.iters)
                label = directions[0] if len(directions) == 1 else "both"
                return [dict(segment_bytes=seg, copies=count, direction=label, seconds=s,
                             gbps_per_direction=count * seg / s / 1e9)]
            rows.extend(guarded(one, segment_bytes=seg, directions=directions))
    return rows


def run_segment_sweep_graph(cfg: Config, streams: Streams) -> list[dict]:
    """The segment sweep's copies issued from a captured CUDA graph (cupy's cudaMemcpyAsync, captured
    with torch): no Python per copy, close to what a C++ copy loop such as vLLM's swap_blocks pays."""
    if cfg.device.type != "cuda":
        return []
    try:
        import cupy
    except ImportError:
        return [dict(error="cupy not installed: no graph-issued segment sweep")]
    volume = min(cfg.volume, 256 * MB)
    dev, host = segment_buffers(cfg, volume)
    kind = {"out": 2, "in": 1}  # cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice
    stream_of = {"out": streams.out, "in": streams.into}
    rows = []
    for seg in SEGMENT_SIZES_GPU:
        count = max(1, min(volume // seg, 1024))

        def capture(direction: str) -> torch.cuda.CUDAGraph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream_of[direction]):
                raw = torch.cuda.current_stream().cuda_stream
                for i in range(count):
                    d, h = dev[direction].data_ptr() + i * seg, host[direction].data_ptr() + i * seg
                    src, dst = (d, h) if direction == "out" else (h, d)
                    cupy.cuda.runtime.memcpyAsync(dst, src, seg, kind[direction], raw)
            return graph

        def one() -> list[dict]:
            graphs = {d: capture(d) for d in ("out", "in")}
            out = []
            for directions in (("out",), ("in",), ("out", "in")):
                def run(directions=directions) -> None:
                    for d in directions:
                        with torch.cuda.stream(stream_of[d]):
                            graphs[d].replay()
                s = median_seconds(streams, run, cfg.iters)
                label = directions[0] if len(directions) == 1 else "both"
                out.append(dict(segment_bytes=seg, copies=count, direction=label, seconds=s, issue="cuda-graph",
                                gbps_per_direction=count * seg / s / 1e9))
            return out

        rows.extend(guarded(one, segment_bytes=seg, issue="cuda-graph"))
    return rows


def guarded(fn: Callable[[], list[dict]], **where: object) -> list[dict]:
    """One failing measurement must not lose the rest of a 30-minute GPU session."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, run goes on
        print(f"  ! {where} failed: {e!r}", file=sys.stderr)
        return [dict(**where, error=repr(e))]


# ---------------------------------------------------------------- Llama-3-8B-shaped rotation


def run_rotation(cfg: Config, streams: Streams) -> list[dict]:
    r = cfg.rotation
    tokens, bt = r["tokens"], r["block_tokens"]
    pool = DevicePoolView.synthetic(2 * tokens + bt, r["layers"], r["kv_heads"], r["head_dim"], r["dtype"], cfg.device)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.view(torch.uint8).random_(0, 256)
    host = HostKVPool(math.ceil(tokens / bt) + 1, r["layers"], r["kv_heads"], r["head_dim"], bt, r["dtype"])
    pages = torch.randperm(2 * tokens // bt)  # SGLang hands out pages in no particular order
    per_half = tokens // bt
    out_slots, in_slots = (
        (pages[i * per_half : (i + 1) * per_half, None] * bt + torch.arange(bt)).flatten().to(cfg.device) for i in (0, 1)
    )
    transfers = ["naive", "torch"] + [m for m in ("triton-dma", "triton-direct") if m in cfg.methods]
    rows = []
    for transfer in transfers:
        one = lambda: [rotate(cfg, streams, pool, host, transfer, out_slots, in_slots)]  # noqa: E731
        rows.extend(guarded(one, transfer=transfer))
    return rows


def rotate(
    cfg: Config,
    streams: Streams,
    pool: DevicePoolView,
    host: HostKVPool,
    transfer: str,
    out_slots: torch.Tensor,
    in_slots: torch.Tensor,
) -> dict:
    """Save out_slots to host and load them back into in_slots with one engine path; bit-exact check."""
    engine = RotationEngine(pool, host, transfer=transfer, max_programs=cfg.max_sms)
    nbytes = out_slots.numel() * pool.bytes_per_token
    saved = []

    def out() -> None:
        if saved:
            engine.free(saved.pop())
        saved.append(engine.save(out_slots))

    t_out = median_seconds(streams, out, cfg.iters)
    t_in = median_seconds(streams, lambda: engine.load(saved[0], in_slots), cfg.iters)
    exact = all(torch.equal(b.view(torch.uint8)[in_slots], b.view(torch.uint8)[out_slots])
                for b in pool.k_buffers + pool.v_buffers)
    engine.free(saved.pop())
    return dict(transfer=transfer, tokens=out_slots.numel(), bytes=nbytes, out_ms=t_out * 1e3, in_ms=t_in * 1e3,
                out_gbps=nbytes / t_out / 1e9, in_gbps=nbytes / t_in / 1e9, bit_exact=exact,
                host_pinned=host.pinned, shape={k: str(v) for k, v in cfg.rotation.items()})


# ---------------------------------------------------------------- report


def meta(cfg: Config) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = cfg.device.type == "cuda"
    return dict(
        device=torch.cuda.get_device_name(cfg.device) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        sms=torch.cuda.get_device_properties(cfg.device).multi_processor_count if cuda else None,
        torch=torch.__version__,
        triton=triton_version,
        triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
        mode="gpu" if cuda else "cpu-smoke",
        kv_heads=cfg.shape.kv_heads,
        head_dim=cfg.shape.head_dim,
        dtype=str(cfg.shape.dtype),
        volume_bytes_per_direction=cfg.volume,
        max_sms=cfg.max_sms,
        iters=cfg.iters,
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def plot(result: dict, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (re-plot with --plot-from)", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
    for ax, direction in zip(axes, ("out", "in", "both")):
        rows = [r for r in result["sweep"] if r.get("direction") == direction]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["block_bytes"], r["gbps_per_direction"]) for r in rows if r["method"] == method)
            ax.plot([p[0] / 2**10 for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (KiB)")
        ax.set_title({"out": "device -> host", "in": "host -> device", "both": "both at once (per direction)"}[direction])
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"KV transfer, {result['meta']['device']}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def summarize(result: dict) -> None:
    print(f"device: {result['meta']['device']}")
    for r in result.get("sweep", []):
        if "error" in r:
            print(f"  {r['method']:<34} {r['block_bytes']:>9} B  ERROR {r['error']}")
            continue
        if r["direction"] == "out-one-block":
            print(f"  {r['method']:<34} {r['block_bytes']:>9} B  one block out {r['latency_us']:10.1f} us")
        else:
            print(f"  {r['method']:<34} {r['block_bytes']:>9} B  {r['direction']:<5} {r['gbps_per_direction']:9.3f} GB/s")
    for r in result.get("sm_sweep", []):
        if "error" not in r:
            print(f"  {r['method']:<14} {r['direction']:<3} {r['programs']:>4} programs {r['gbps']:8.2f} GB/s")
    for key, label in (("segments", "segment"), ("segments_graph", "graph segment")):
        for r in result.get(key, []):
            if "error" not in r:
                print(f"  {label} {r['segment_bytes']:>9} B x {r['copies']:>5} {r['direction']:<4} "
                      f"{r['gbps_per_direction']:8.2f} GB/s")
    for r in result.get("tuning", []):
        if "error" not in r:
            print(f"  tuning {r['method']:<14} tile {r['tile_words']:>6} warps {r['num_warps']:>2} {r['direction']:<4} "
                  f"{r['gbps_per_direction']:8.2f} GB/s")
    for r in result.get("rotation", []):
        if "error" in r:
            print(f"  rotation {r['transfer']:<14} ERROR {r['error']}")
        else:
            print(f"  rotation {r['transfer']:<14} out {r['out_ms']:9.2f} ms ({r['out_gbps']:.2f} GB/s) "
                  f"in {r['in_ms']:9.2f} ms ({r['in_gbps']:.2f} GB/s) exact={r['bit_exact']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: results/kv_transfer_<device>.json)")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--max-sms", type=int, default=8, help="cap on the kernel paths' persistent grid")
    p.add_argument("--gib", type=float, default=1.0, help="GiB moved per direction per measurement (GPU)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run (Triton paths need TRITON_INTERPRET=1)")
    p.add_argument("--plot-from", type=Path, default=None, help="only re-plot an existing JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        plot(json.loads(args.plot_from.read_text()), args.plot or args.plot_from.with_suffix(".png"))
        return
    cfg = config_from_args(args)
    streams = Streams(cfg.device)
    out = args.out or REPO / "results" / f"kv_transfer_{slug(torch.cuda.get_device_name() if cfg.device.type == 'cuda' else 'cpu')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"meta": meta(cfg)}
    sections = {"sweep": run_sweep, "sm_sweep": run_sm_sweep, "segments": run_segment_sweep,
                "segments_graph": run_segment_sweep_graph, "tuning": run_tuning_sweep, "rotation": run_rotation}
    for name, run in sections.items():  # the JSON is rewritten after each section: a cut-off run keeps its data
        t0 = time.perf_counter()
        result[name] = run(cfg, streams)
        out.write_text(json.dumps(result, indent=1))
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    summarize(result)
    png = args.plot or out.with_suffix(".png")
    print(f"wrote {out}" + (f" and {png}" if plot(result, png) else ""))


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


if __name__ == "__main__":
    main()
