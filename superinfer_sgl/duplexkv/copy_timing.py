"""How long rotation copies take, per direction, and how long both directions run at once.

On a GPU each direction's copies of one `RotationEngine.rotate` call (and of each prefetch) are
bracketed by two timing events recorded on that direction's lane, after the lane's waits: the span
is the copy itself, not the wait for the forward pass that wrote the KV. Events are read only once
the copy has finished (when the engine reaps its copies), so timing never blocks the scheduler.
On a CPU the copies run synchronously and the spans are wall clock (perf_counter).

overlap: for a rotate() call that moved KV both ways, the time both spans were running together,
max(0, min(end_out, end_in) - max(start_out, start_in)). On a CPU the directions run one after the
other, so it is 0 there by construction.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

DIRECTIONS = ("out", "in")


@dataclass
class Span:
    """One direction's copies of one call: two timing events (CUDA) or two perf_counter stamps."""

    start: torch.cuda.Event | float
    end: torch.cuda.Event | float | None = None

    def done(self) -> bool:
        return not isinstance(self.end, torch.cuda.Event) or self.end.query()

    def bounds_s(self, ref: Span) -> tuple[float, float]:
        """(start, end) in seconds relative to `ref`'s start (both spans finished)."""
        if isinstance(self.start, torch.cuda.Event):
            assert isinstance(ref.start, torch.cuda.Event) and isinstance(self.end, torch.cuda.Event)
            return ref.start.elapsed_time(self.start) / 1e3, ref.start.elapsed_time(self.end) / 1e3
        assert isinstance(ref.start, float) and isinstance(self.end, float)
        return self.start - ref.start, self.end - ref.start


@dataclass
class TimedCall:
    """The spans of one rotate()/prefetch() call, by direction."""

    spans: dict[str, Span] = field(default_factory=dict)

    def done(self) -> bool:
        return all(s.done() for s in self.spans.values())


class CopyTimer:
    """Totals of copy seconds per direction and of the seconds both directions overlapped."""

    def __init__(self) -> None:
        self.seconds = {d: 0.0 for d in DIRECTIONS}
        self.calls = {d: 0 for d in DIRECTIONS}  # timed spans per direction
        self.overlap_s = 0.0
        self.duplex_calls = 0  # calls whose two directions were both timed
        self.last: dict[str, float] = {}  # the last finished call: seconds per direction, and overlap
        self._pending: list[TimedCall] = []

    @contextlib.contextmanager
    def span(self, call: TimedCall, direction: str, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Time the body's copies on `stream` (None: a CPU lane, timed by wall clock)."""
        if stream is None:
            t0 = time.perf_counter()
            yield
            call.spans[direction] = Span(t0, time.perf_counter())
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        call.spans[direction] = Span(start, end)

    def add(self, call: TimedCall) -> None:
        """Hand over a call's spans; they are read once every one of them has finished."""
        if call.spans:
            self._pending.append(call)
        self.reap()

    def reap(self) -> None:
        """Read the finished calls (never blocks)."""
        running = []
        for call in self._pending:
            if call.done():
                self._read(call)
            else:
                running.append(call)
        self._pending = running

    def drain(self) -> None:
        for call in self._pending:
            for s in call.spans.values():
                if isinstance(s.end, torch.cuda.Event):
                    s.end.synchronize()
        self.reap()

    def _read(self, call: TimedCall) -> None:
        ref = next(iter(call.spans.values()))
        bounds = {d: s.bounds_s(ref) for d, s in call.spans.items()}
        self.last = {}
        for d, (t0, t1) in bounds.items():
            self.seconds[d] += max(0.0, t1 - t0)
            self.calls[d] += 1
            self.last[d] = max(0.0, t1 - t0)
        if len(bounds) == 2:
            (a0, a1), (b0, b1) = bounds["out"], bounds["in"]
            both = max(0.0, min(a1, b1) - max(a0, b0))
            self.overlap_s += both
            self.duplex_calls += 1
            self.last["overlap"] = both

    def totals(self) -> dict[str, float]:
        return {"out_s": self.seconds["out"], "in_s": self.seconds["in"], "overlap_s": self.overlap_s,
                "out_calls": self.calls["out"], "in_calls": self.calls["in"], "duplex_calls": self.duplex_calls}
