"""Rotation / swap engines: seconds to move KV bytes between device and host in one iteration.

naive    one copy per page (block_tokens tokens) per layer per K/V, directions one after the
         other: what stock swap does (vLLM V0 swap_blocks, our --kv-transfer naive).
batched  one batched transfer per direction, directions one after the other, no eager sync (an
         ablation: our runtime before DuplexKV's one-call duplex step).
duplex   DuplexKV as our runtime runs it (integration/rotation.py: rotate_step, one
         engine.rotate call per step carrying the outs and the ins): block-first host layout, one
         batched transfer per direction, both directions at once, and eager sync (full blocks of
         running requests are copied to host in the background, so a rotate-out moves only what
         was written since: the tail).
free     zero-cost moves (the idealised reference).
"""

from __future__ import annotations

from dataclasses import dataclass

from superinfer_sgl.sim.profile import LinkModel, ModelShape


@dataclass(frozen=True)
class TransferEngine:
    name: str
    eager_sync: bool

    def seconds(self, out_bytes: float, in_bytes: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class NaiveCopies(TransferEngine):
    link: LinkModel
    segment_bytes: float

    def seconds(self, out_bytes: float, in_bytes: float) -> float:
        return self.link.per_copy_seconds(out_bytes, in_bytes, self.segment_bytes)


@dataclass(frozen=True)
class Batched(TransferEngine):
    link: LinkModel
    duplex: bool

    def seconds(self, out_bytes: float, in_bytes: float) -> float:
        return self.link.batched_seconds(out_bytes, in_bytes, duplex=self.duplex)


@dataclass(frozen=True)
class FreeMoves(TransferEngine):
    def seconds(self, out_bytes: float, in_bytes: float) -> float:
        return 0.0


def make_engine(kind: str, link: LinkModel, model: ModelShape, block_tokens: int) -> TransferEngine:
    if kind == "naive":
        return NaiveCopies("naive", False, link, model.page_segment_bytes(block_tokens))
    if kind == "batched":
        return Batched("batched", False, link, duplex=False)
    if kind == "duplex":
        return Batched("duplex", True, link, duplex=True)
    if kind == "free":
        return FreeMoves("free", False)
    raise ValueError(f"unknown transfer engine {kind!r}: naive, batched, duplex or free")
