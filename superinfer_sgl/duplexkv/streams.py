"""Copy lanes and completion events: CUDA side streams on a GPU, synchronous no-ops on a CPU.

The engine runs the same orchestration on both: a copy is issued inside `lane.run(...)` and
`lane.record()` returns its event. On a CPU the body simply runs and the event is DONE, so every
test of the bookkeeping (who waits on what, who holds which block until when) runs without a GPU.

On a GPU, everything behind `self.stream is not None` (stream ordering, events, record_stream) ran in
the CUDA-marked unit tests on a lent H100 (docs/status.md); the CPU suite runs the
synchronous lanes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, Union

import torch

from superinfer_sgl.duplexkv.host_pool import BlockAllocator, HostKV


class CopyEvent(Protocol):
    """What the engine needs of a completion event (torch.cuda.Event has it)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    """The event of a copy that has already finished (every copy on a CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "DONE"


DONE: CopyEvent = _Done()


# What a copy is ordered after: None (the current stream), one event, or several.
After = Union[CopyEvent, Sequence[CopyEvent], None]


def as_events(after: After) -> list[CopyEvent]:
    if after is None:
        return []
    return list(after) if isinstance(after, (list, tuple)) else [after]


def cuda_events(events: Iterable[CopyEvent | None]) -> list[torch.cuda.Event]:
    return [e for e in events if isinstance(e, torch.cuda.Event)]


class CopyLane:
    """One copy direction: a CUDA side stream, or None on a CPU (the body runs synchronously)."""

    def __init__(self, device: torch.device, priority: int = 0) -> None:
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device, priority=priority) if cuda else None

    @contextlib.contextmanager
    def run(self, after: After = None, also: Iterable[CopyEvent] = ()) -> Iterator[None]:
        """Run the body on this lane, ordered after the event(s) `after` (when None: after everything
        already queued on the current stream) and after every event in `also`. `after` replaces the
        current-stream dependency, so it must cover every GPU write the copy depends on (the KV, and
        the slot indices if a kernel produced them). On error, waits for what the body queued, since
        the caller is about to free the blocks those copies touch."""
        if self.stream is None:
            yield
            return
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        for event in cuda_events([*as_events(after), *also]):
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            try:
                yield
            except BaseException:
                self.stream.synchronize()
                raise

    def record(self) -> CopyEvent:
        """Event completing when everything issued on this lane so far has run."""
        if self.stream is None:
            return DONE
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def keep_alive(self, t: torch.Tensor) -> None:
        """A caller's device tensor read on this lane must not be reused by the caching allocator for
        another stream before the read has run."""
        if self.stream is not None and t.is_cuda:
            t.record_stream(self.stream)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


@dataclass(frozen=True)
class RotationHandle:
    """The copies of one rotate()/prefetch() call.

    saved: one HostKV per rotated-out request, in the order given; the caller owns one reference
    each (free them with engine.free). Their bytes are final only once the handle is done.
    """

    saved: tuple[HostKV, ...] = ()
    events: tuple[CopyEvent, ...] = ()

    def done(self) -> bool:
        """Poll: have all copies finished? (Never blocks.)"""
        return all(e.query() for e in self.events)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current stream) wait for the copies; the CPU does not block.
        Call before the forward pass that reads loaded KV or reuses the device slots saved from."""
        for event in cuda_events(self.events):
            event.wait(stream)

    def synchronize(self) -> None:
        """Block the CPU until all copies have finished (an event wait, not a busy loop)."""
        for event in self.events:
            event.synchronize()


class InflightCopies:
    """Host-block references held by copies that may still be running, so that no block is handed out
    again (and overwritten) while a queued copy still reads or writes it. On a CPU every copy has
    finished by the time it is held, and the next reap() releases it."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._copies: list[tuple[CopyEvent, list[int]]] = []

    def hold(self, event: CopyEvent, blocks: list[int]) -> None:
        """Take over one already-taken reference on each of `blocks` until `event` completes."""
        self._copies.append((event, blocks))

    def reap(self) -> None:
        """Release the references of the copies that have finished (never blocks)."""
        running = []
        for event, blocks in self._copies:
            if event.query():
                self.allocator.decref(blocks)
            else:
                running.append((event, blocks))
        self._copies = running

    def drain(self) -> None:
        """Wait for every copy (event waits) and release everything."""
        for event, _ in self._copies:
            event.synchronize()
        self.reap()

    def refs(self) -> Counter[int]:
        return Counter(b for _, blocks in self._copies for b in blocks)
