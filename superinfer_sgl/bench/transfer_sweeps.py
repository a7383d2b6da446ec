"""The KV transfer benchmark's sections: block-size sweep, SM sweep, segment sweeps (Python-issued
and graph-issued), tile tuning, the staging ring's sizes, and one model-shaped rotation through
RotationEngine.

Every section returns rows (dicts); a failing measurement becomes a row with an `error` so one
failure does not lose the rest of a GPU call.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator

import torch

from ..duplexkv import DevicePoolView, HostKVPool, RotationEngine
from .transfer_rig import (
    KERNEL_METHODS,
    MB,
    Config,
    Rig,
    Streams,
    build_rig,
    drain,
    measure,
    median_seconds,
    ops_per_block,
    ops_per_direction,
    tokens_for,
)


def sweep_rows(cfg: Config, streams: Streams, rig: Rig, block_bytes: int, method: str) -> list[dict]:
    tokens = tokens_for(cfg, rig, method)
    nbytes = tokens * rig.token_bytes
    blocks = tokens // rig.block_tokens
    ring = getattr(rig.path(method), "rings", {}) if method in KERNEL_METHODS else {}
    slot_blocks = next(iter(ring.values())).slot_blocks if ring else 0
    base = dict(
        method=method,
        block_bytes=block_bytes,
        layers=rig.layers,
        block_tokens=rig.block_tokens,
        piece_bytes=rig.block_tokens * cfg.shape.row_bytes if ops_per_block(method, rig.layers) else block_bytes,
        bytes_per_direction=nbytes,
        programs=rig.max_sms if method in KERNEL_METHODS else 0,
        ops_per_direction=ops_per_direction(method, blocks, rig.layers, slot_blocks),
        **({"ring_slots": next(iter(ring.values())).slots, "slot_blocks": slot_blocks} if ring else {}),
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
            one = lambda rig=rig, method=method: sweep_rows(cfg, streams, rig, block_bytes, method)  # noqa: E731
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


# (slots, blocks per slot) of the ring sweep, at 2 MiB blocks (16 tokens of Llama-3-8B in bf16) on a GPU:
# slots of 2..32 MiB; the engine's default is 3 x 16 MiB (duplexkv/staging_ring.py)
RING_SWEEP = [(2, 4), (3, 1), (3, 2), (3, 4), (3, 8), (3, 16), (4, 4)]


def run_ring_sweep(cfg: Config, streams: Streams) -> list[dict]:
    """triton-dma (the pipelined ring) for several ring sizes, one way and both ways at once, beside
    its serial form and the ceiling on the same rig: what the slot count and size buy."""
    if "triton-dma" not in cfg.methods:
        return []
    cuda = cfg.device.type == "cuda"
    block_bytes = 2 * MB if cuda else cfg.block_sizes[0]
    rig = build_rig(cfg, block_bytes)
    nbytes = rig.tokens * rig.token_bytes
    rows = []
    sizes = RING_SWEEP if cuda else [(2, 16)]  # a CPU runs the kernels interpreted: one ring of 4 chunks
    variants = [("memcpy-ceiling", None), ("triton-dma-serial", None)] + [("triton-dma", r) for r in sizes]
    for method, ring in variants:
        if ring is not None:
            rig.paths.clear()  # one ring's staging at a time
            rig.ring = dict(ring_slots=ring[0], ring_slot_bytes=ring[1] * rig.token_bytes * rig.block_tokens)
        for directions in (("out",), ("in",), ("out", "in")):
            def one(method=method, ring=ring, directions=directions) -> list[dict]:
                s = measure(cfg, streams, rig, method, directions, rig.tokens)
                label = directions[0] if len(directions) == 1 else "both"
                return [dict(method=method, direction=label, block_bytes=block_bytes, seconds=s,
                             gbps_per_direction=nbytes / s / 1e9,
                             **({"ring_slots": ring[0], "slot_blocks": ring[1],
                                 "slot_bytes": ring[1] * rig.token_bytes * rig.block_tokens} if ring else {}))]
            rows.extend(guarded(one, method=method, ring=ring, directions=directions))
    rig.ring = dict(cfg.ring)
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


def run_rotation(cfg: Config, streams: Streams) -> list[dict]:
    r = cfg.rotation
    tokens, bt = r["tokens"], r["block_tokens"]
    pool = DevicePoolView.synthetic(2 * tokens + bt, r["layers"], r["kv_heads"], r["head_dim"], r["dtype"], cfg.device)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.view(torch.uint8).random_(0, 256)
    # room for two copies of the request: one parked, one rotating out while it comes back (duplex)
    host = HostKVPool(2 * math.ceil(tokens / bt) + 1, r["layers"], r["kv_heads"], r["head_dim"], bt, r["dtype"])
    pages = torch.randperm(2 * tokens // bt)  # SGLang hands out pages in no particular order
    per_half = tokens // bt
    out_slots, in_slots = (
        (pages[i * per_half : (i + 1) * per_half, None] * bt + torch.arange(bt)).flatten().to(cfg.device) for i in (0, 1)
    )
    kernels = ("triton-dma", "triton-dma-serial", "triton-hybrid", "triton-direct")
    transfers = [m for m in ("naive",) if m in cfg.methods] + ["torch"] + [m for m in kernels if m in cfg.methods]
    rows = []
    for transfer in transfers:
        one = lambda transfer=transfer: [rotate(cfg, streams, pool, host, transfer, out_slots, in_slots)]  # noqa: E731
        rows.extend(guarded(one, transfer=transfer))
    if cfg.device.type == "cuda":  # what `auto` picks here: the engine's startup probe of the candidates
        rows.extend(guarded(lambda: [auto_pick(cfg, pool, host)], transfer="auto"))
    return rows


def auto_pick(cfg: Config, pool: DevicePoolView, host: HostKVPool) -> dict:
    engine = RotationEngine(pool, host, transfer="auto", max_programs=cfg.max_sms, ring=cfg.ring)
    engine.quiesce()
    return dict(transfer="auto", chosen=engine.transfer,
                probe_duplex_ms={k: round(v * 1e3, 3) for k, v in engine.transfer_probe.items()})


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
    engine = RotationEngine(pool, host, transfer=transfer, max_programs=cfg.max_sms, ring=cfg.ring)
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

    def duplex() -> None:  # one rotate call: out_slots out while the parked copy comes back in
        handle = engine.rotate(out=[(None, out_slots, out_slots.numel())], inn=[(saved[0], in_slots)])
        handle.synchronize()
        for hk in handle.saved:
            engine.free(hk)

    t_both = median_seconds(streams, duplex, cfg.iters)
    engine.quiesce()
    timed = dict(engine.copy_timer.last)  # the engine's own events (wall clock on a CPU) of the last duplex call
    engine.free(saved.pop())
    return dict(transfer=transfer, tokens=out_slots.numel(), bytes=nbytes, out_ms=t_out * 1e3, in_ms=t_in * 1e3,
                out_gbps=nbytes / t_out / 1e9, in_gbps=nbytes / t_in / 1e9, bit_exact=exact,
                duplex_ms=t_both * 1e3, duplex_gbps_per_direction=nbytes / t_both / 1e9,
                engine_copy_ms={k: round(v * 1e3, 3) for k, v in timed.items()},
                host_pinned=host.pinned, shape={k: str(v) for k, v in cfg.rotation.items()})
