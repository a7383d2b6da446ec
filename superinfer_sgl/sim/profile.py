"""Cost profiles: how long an iteration computes and how fast KV moves over the host link.

A profile is a JSON file (profiles/*.json) with four sections, each documented by its dataclass:
  model   KV geometry (bytes per token, layers) of the served model
  server  device KV capacity and SGLang batch limits
  step    iteration time as a function of the batch (StepModel)
  link    device<->host bandwidth against segment size, per copy or batched, one way or duplex
plus `sources` and `assumptions` lists saying where every number comes from.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import dataclass, field, fields
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_bytes_per_token: int  # all layers, all buffers
    kv_buffers_per_layer: int = 2  # K and V; 1 for MLA's latent (kv_geometry)

    def __post_init__(self) -> None:
        assert self.layers >= 1 and self.kv_bytes_per_token >= 1, self
        assert self.kv_buffers_per_layer in (1, 2), self

    def page_segment_bytes(self, page_tokens: int) -> int:
        """One naive copy: one page of one layer's K (or V, or MLA latent)."""
        return page_tokens * self.kv_bytes_per_token // (self.kv_buffers_per_layer * self.layers)


@dataclass(frozen=True)
class ServerLimits:
    kv_tokens: int  # device KV pool (SGLang --max-total-tokens)
    chunked_prefill_tokens: int | None = 8192  # SGLang --chunked-prefill-size (None: off)
    max_prefill_tokens: int = 16384  # SGLang --max-prefill-tokens
    max_running_requests: int = 4096
    host_kv_tokens: int = 10**9  # host memory for rotated-out / swapped KV
    # Client-side latency outside the scheduler (HTTP, chat template, tokenization, streaming the
    # first token back): a request reaches the scheduler this much after it was sent, and its
    # TTFT (measured from the send, as a client does) includes it.
    request_overhead_s: float = 0.0
    # SGLang's overlap scheduler processes a batch's results (streams its tokens) after launching
    # the next batch. On a GPU the launch returns at once; on a CPU the forward runs inside the
    # launch, so a step's tokens reach clients only when the following step ends (at once when
    # nothing follows). Measured on the CPU server's step log: see docs/sim.md.
    emit_after_next_step: bool = False

    def __post_init__(self) -> None:
        assert self.kv_tokens >= 1 and self.max_prefill_tokens >= 1, self
        assert math.isfinite(self.request_overhead_s) and self.request_overhead_s >= 0, self
        assert self.chunked_prefill_tokens is None or self.chunked_prefill_tokens >= 1, self


@dataclass(frozen=True)
class StepModel:
    """Seconds of one iteration (prefill and/or decode of a batch):

      base + [prefill_base if prefill] + max(floor, per_prefill_token*P + per_decode_token*B)
           + per_context_token*C + per_prefill_pair*Q + per_prefill_req*R

    P prefill tokens, R prefill requests, Q attention pairs of the prefill
    (sum of extend x (prefix + extend/2)), B decoding requests, C their context tokens.
    `floor` is the weight-read time of a memory-bound step (roofline); 0 for a fitted linear model.
    The simulator adds per_resume_s for each resumed request re-admitted through the radix tree
    (our runtime's resume path): the server's rotation work beyond the copies and the extend.
    """

    base_s: float
    prefill_base_s: float = 0.0
    floor_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_decode_token_s: float = 0.0
    per_context_token_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    per_prefill_req_s: float = 0.0
    per_resume_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            assert math.isfinite(v) and v >= 0, f"step.{f.name} must be finite and >= 0, got {v}"

    def seconds(self, prefill_tokens: int = 0, prefill_pairs: float = 0.0, prefill_reqs: int = 0,
                decode_reqs: int = 0, decode_context: int = 0) -> float:
        if prefill_tokens == 0 and decode_reqs == 0:
            return 0.0
        linear = self.per_prefill_token_s * prefill_tokens + self.per_decode_token_s * decode_reqs
        t = self.base_s + max(self.floor_s, linear) + self.per_context_token_s * decode_context
        if prefill_tokens:
            t += (self.prefill_base_s + self.per_prefill_pair_s * prefill_pairs
                  + self.per_prefill_req_s * prefill_reqs)
        return t

    def prefill_alone(self, tokens: int) -> float:
        return self.seconds(tokens, tokens * tokens / 2.0, 1)


def _loglog(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Log-log interpolation of bandwidth ys at segment sizes xs.

    Below the smallest size a copy costs what the smallest costs (latency-bound: bandwidth
    proportional to size); above the largest the bandwidth stays at the largest's.
    """
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


@dataclass(frozen=True)
class LinkModel:
    """Device<->host link. GB/s are 1e9 bytes/s of KV payload; d2h = out (rotate/swap out).

    per_copy_*: back-to-back copies of one segment size each (one launch or DMA per segment).
    batched_*: one batched transfer per direction (DuplexKV), one way at a time.
    duplex_*: each way while both directions run at once; None: the directions serialise.
    """

    name: str
    segment_bytes: tuple[float, ...]
    per_copy_d2h_gbps: tuple[float, ...]
    per_copy_h2d_gbps: tuple[float, ...]
    batched_d2h_gbps: float
    batched_h2d_gbps: float
    duplex_d2h_gbps: float | None = None
    duplex_h2d_gbps: float | None = None
    launch_s: float = 0.0  # fixed cost per batched transfer and direction

    def __post_init__(self) -> None:
        n = len(self.segment_bytes)
        assert n >= 1 and len(self.per_copy_d2h_gbps) == n == len(self.per_copy_h2d_gbps), self.name
        assert list(self.segment_bytes) == sorted(self.segment_bytes), "segment_bytes must ascend"
        assert min(self.per_copy_d2h_gbps + self.per_copy_h2d_gbps) > 0, self.name
        assert self.batched_d2h_gbps > 0 and self.batched_h2d_gbps > 0, self.name
        assert (self.duplex_d2h_gbps is None) == (self.duplex_h2d_gbps is None), self.name

    def per_copy_gbps(self, segment: float, d2h: bool) -> float:
        ys = self.per_copy_d2h_gbps if d2h else self.per_copy_h2d_gbps
        return _loglog(self.segment_bytes, ys, segment)

    def per_copy_seconds(self, out_bytes: float, in_bytes: float, segment: float) -> float:
        """Per-segment copies on one stream: directions one after the other."""
        t = 0.0
        if out_bytes:
            t += out_bytes / (self.per_copy_gbps(segment, True) * GB)
        if in_bytes:
            t += in_bytes / (self.per_copy_gbps(segment, False) * GB)
        return t

    def batched_seconds(self, out_bytes: float, in_bytes: float, duplex: bool = True) -> float:
        """One batched transfer per direction; both at once at duplex rates when `duplex` and the
        link has duplex figures, else one after the other."""
        bo, bi = self.batched_d2h_gbps * GB, self.batched_h2d_gbps * GB
        launches = self.launch_s * ((out_bytes > 0) + (in_bytes > 0))
        if not duplex or self.duplex_d2h_gbps is None or not (out_bytes and in_bytes):
            return launches + out_bytes / bo + in_bytes / bi
        do, di = self.duplex_d2h_gbps * GB, self.duplex_h2d_gbps * GB  # type: ignore[operator]
        t_out, t_in = out_bytes / do, in_bytes / di
        both = min(t_out, t_in)  # both directions busy; then the longer one runs alone
        rest = (out_bytes - both * do) / bo if t_out > t_in else (in_bytes - both * di) / bi
        return launches + both + rest


@dataclass(frozen=True)
class SchedulerCost:
    """CPU time of scheduling decisions that the simulator adds to an iteration."""

    lvf_s_per_view: float = 0.0  # lvf_decide per request view (results/bench_policy.json)


@dataclass(frozen=True)
class Profile:
    name: str
    model: ModelShape
    server: ServerLimits
    step: StepModel
    link: LinkModel
    scheduler: SchedulerCost = field(default_factory=SchedulerCost)
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
    path: str = ""

    def with_server(self, **changes: object) -> Profile:
        from dataclasses import replace

        return replace(self, server=replace(self.server, **changes))


def _build(cls: type, raw: dict, where: str) -> object:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names - {"comment"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected some of {sorted(names)}")
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k != "comment"}
    return cls(**args)


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    raw = json.loads(path.read_text())
    return Profile(
        name=raw["name"],
        model=_build(ModelShape, raw["model"], f"{path}: model"),  # type: ignore[arg-type]
        server=_build(ServerLimits, raw["server"], f"{path}: server"),  # type: ignore[arg-type]
        step=_build(StepModel, raw["step"], f"{path}: step"),  # type: ignore[arg-type]
        link=_build(LinkModel, raw["link"], f"{path}: link"),  # type: ignore[arg-type]
        scheduler=_build(SchedulerCost, raw.get("scheduler", {}), f"{path}: scheduler"),  # type: ignore[arg-type]
        sources=tuple(raw.get("sources", ())),
        assumptions=tuple(raw.get("assumptions", ())),
        path=str(path),
    )


PROFILE_DIR = Path(__file__).resolve().parents[2] / "profiles"


def resolve_profile(name_or_path: str) -> Profile:
    """A profile by file path, or by name in profiles/ (e.g. 'gh200-qwen2.5-32b')."""
    p = Path(name_or_path)
    if p.exists():
        return load_profile(p)
    candidate = PROFILE_DIR / f"{name_or_path}.json"
    if candidate.exists():
        return load_profile(candidate)
    known = sorted(x.stem for x in PROFILE_DIR.glob("*.json"))
    raise FileNotFoundError(f"no profile {name_or_path!r}; known: {known}")
