"""Penalty state for requests that re-enter an extend batch with outputs (a resume, a recompute).

SGLang keeps the sampling penalties' running state per batch row, not per request: frequency and
presence counts, repetition marks and the min_new_tokens count start empty when
`prepare_for_extend` builds a batch's `SamplingBatchInfo`, and each decode step adds the last
output token. A request that was paused and resumes (or was retracted and is recomputed) joins a
new extend batch with outputs already produced, so its row starts as if it had none, and its next
tokens differ from the request served alone (without this, 6 of the 8 penalty-and-loop cases of
tests/e2e/test_server.py changed greedy outputs under forced rotations). `restore(batch, overlap)`
fills those rows as the request's own decode steps would have (`counted`).

Runs right after `ScheduleBatch.prepare_for_extend` (hooks.py), where SGLang has just built the
rows, before a mixed step appends the running requests' rows (which keep theirs) and before the
forward copies the penalties (`copy_for_forward`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)
_unknown_logged: set[str] = set()


def _frequency(pen: Any, row: int, ids: torch.Tensor) -> None:
    add = pen.frequency_penalties[row].expand(ids.numel())
    pen.cumulated_frequency_penalties[row].index_add_(0, ids, add)


def _presence(pen: Any, row: int, ids: torch.Tensor) -> None:
    pen.cumulated_presence_penalties[row, ids] = pen.presence_penalties[row]


def _repetition(pen: Any, row: int, ids: torch.Tensor) -> None:
    pen.cumulated_repetition_penalties[row, ids] = pen.repetition_penalties[row]


def _min_new_tokens(pen: Any, row: int, ids: torch.Tensor) -> None:
    pen.len_output_tokens[row] = ids.numel()


# SGLang 0.5.23's penalizers (sglang.srt.sampling.penaltylib), by class name: how one row takes
# the outputs it had. A penalizer not listed here is left as SGLang built it (logged once): a newer
# SGLang's penalizer needs its rule here (tests/unit/test_penalty_rows.py lists SGLang's).
RESTORE: dict[str, Callable[[Any, int, torch.Tensor], None]] = {
    "BatchedFrequencyPenalizer": _frequency,
    "BatchedPresencePenalizer": _presence,
    "BatchedRepetitionPenalizer": _repetition,
    "BatchedMinNewTokensPenalizer": _min_new_tokens,
}


def counted(req: Any, overlap: bool) -> list[int]:
    """The tokens SGLang's decode steps have fed a request's penalty row by the time it samples its
    next output. Each decode step's preparation feeds `req.output_ids[-1]` (the prompt's last token
    while there is none). Without the overlap scheduler that is the output just produced: every
    output so far. Under it the step before is still in flight, so the feed lags one step: the
    prompt's last token, then every output but the newest."""
    outputs = list(req.output_ids)
    return [req.origin_input_ids[-1], *outputs[:-1]] if overlap else outputs


def restore(batch: Any, overlap: bool) -> int:
    """Fill the penalty rows of an extend batch's requests that have outputs, as `counted` by a
    scheduler with or without `overlap`; returns how many rows were filled."""
    info = getattr(batch, "sampling_info", None)
    orch = getattr(info, "penalizer_orchestrator", None)
    if orch is None or not orch.is_required:
        return 0
    rows = [(row, req) for row, req in enumerate(batch.reqs) if req.output_ids]
    if not rows:
        return 0
    active = [p for p in orch.penalizers.values() if p.is_prepared()]
    for name in {type(p).__name__ for p in active} - RESTORE.keys() - _unknown_logged:
        _unknown_logged.add(name)
        logger.error("superinfer: no rule restores %s's state for a resumed request; its outputs may "
                     "differ from the request served alone", name)
    active = [p for p in active if type(p).__name__ in RESTORE]
    for row, req in rows:
        ids = torch.tensor(counted(req, overlap), dtype=torch.int64, device=orch.device)
        for pen in active:
            RESTORE[type(pen).__name__](pen, row, ids)
    return len(rows)
