"""A resumed request's penalty rows (integration/penalty_rows.py) on SGLang 0.5.23's own penalizers:
refilled from its outputs, they hold what the decode steps of the request served alone would have
built by the time it samples its next output, with and without the overlap scheduler (whose step
preparation feeds the output before the newest); a fresh request's row keeps what SGLang gave it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.sampling import penaltylib

from superinfer_sgl.integration import penalty_rows

VOCAB = 32
EOS = 2
PENALIZERS = {cls for name, cls in vars(penaltylib).items()
              if name.startswith("Batched") and name.endswith("Penalizer")}
PARAMS = [
    {"frequency_penalty": 0.7},
    {"presence_penalty": 0.9},
    {"repetition_penalty": 1.3},
    {"min_new_tokens": 5},  # 7 outputs: EOS allowed again
    {"frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.1, "min_new_tokens": 3},
]


def _req(outputs: list[int], **params: float) -> Any:
    sp = SimpleNamespace(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                         min_new_tokens=0, stop_token_ids=None)
    for k, v in params.items():
        setattr(sp, k, v)
    tok = SimpleNamespace(eos_token_id=EOS, additional_stop_token_ids=None)
    return SimpleNamespace(sampling_params=sp, output_ids=list(outputs), origin_input_ids=[5, 6, 7],
                           eos_token_ids={EOS}, tokenizer=tok)


class _Batch(SimpleNamespace):
    """The ScheduleBatch fields the penalizers and `restore` read (the orchestrator keeps a weakref)."""


def _batch(reqs: list[Any]) -> Any:
    batch = _Batch(reqs=reqs, device="cpu")
    orch = penaltylib.BatchedPenalizerOrchestrator(vocab_size=VOCAB, batch=batch, penalizers=PENALIZERS)
    batch.sampling_info = SimpleNamespace(penalizer_orchestrator=orch)
    return batch


def _logits(batch: Any) -> torch.Tensor:
    """What the penalties make of flat positive logits, row by row (every penalizer's effect at
    once; a repetition penalty divides a positive logit)."""
    logits = torch.full((len(batch.reqs), VOCAB), 2.0)
    batch.sampling_info.penalizer_orchestrator.apply(logits)
    return logits


def _served_alone(req: Any, overlap: bool) -> Any:
    """The request's row as its own decode steps built it, up to sampling the output after its
    last: each decode step's preparation feeds `output_ids[-1]` (the prompt's last token while
    there is none; ScheduleBatch.prepare_for_decode), where under the overlap scheduler the step
    before has not been processed yet, so `output_ids` lacks the newest output."""
    outputs, req.output_ids = req.output_ids, []
    batch = _batch([req])
    for step in range(1, len(outputs) + 1):  # the extend step (0) feeds nothing
        req.output_ids = outputs[:step - 1] if overlap else outputs[:step]
        fed = req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]
        batch.sampling_info.penalizer_orchestrator.cumulate_output_tokens(torch.tensor([fed]))
    req.output_ids = outputs
    return batch


def test_every_sglang_penalizer_has_a_rule() -> None:
    assert {cls.__name__ for cls in PENALIZERS} == set(penalty_rows.RESTORE)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("params", PARAMS)
def test_resumed_row_equals_the_request_served_alone(params: dict, overlap: bool) -> None:
    outputs = [3, 9, 9, 4, 9, 17, 3]
    alone = _logits(_served_alone(_req(outputs, **params), overlap))
    fresh = _req([], **params)  # a new request beside it: no outputs, its row stays empty
    batch = _batch([fresh, _req(outputs, **params)])
    assert not torch.equal(_logits(batch)[1], alone[0])  # as SGLang builds it: the history is lost
    assert penalty_rows.restore(batch, overlap) == 1
    got = _logits(batch)
    assert torch.equal(got[1], alone[0])
    assert torch.equal(got[0], _logits(_batch([_req([], **params)]))[0])


def test_nothing_to_do_without_penalties_or_outputs() -> None:
    assert penalty_rows.restore(_batch([_req([1, 2, 3])]), overlap=False) == 0  # no penalty asked for
    assert penalty_rows.restore(_batch([_req([], frequency_penalty=0.5)]), overlap=True) == 0  # no output yet
    assert penalty_rows.restore(SimpleNamespace(reqs=[], sampling_info=None), overlap=False) == 0
