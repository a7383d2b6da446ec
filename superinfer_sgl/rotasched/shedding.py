"""TTFT shedding, the goodput policy's admission rule (`GoodputLvf`, --ttft-shedding): which of the
waiting requests that could each get their first token in time alone are served best-effort so
that more of the others get theirs.

Deadline order alone serves a request with a long prompt or a long output ahead of several short
ones that then miss their TTFT behind it. Moore and Hodgson's rule keeps the most jobs on time on
one machine: walk the jobs earliest deadline first, and when one would be late drop the longest
kept so far. Here a job's length is what delays the first tokens of the requests behind it. Pure
Python, one function of the views and the measured step costs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from superinfer_sgl.rotasched.costs import StepCosts
from superinfer_sgl.rotasched.request_view import ReqView
from superinfer_sgl.rotasched.step_size import prefill_time_s

# Viable waiting requests `shed` reads per step, deadline first: its cost is bounded (~1.5 us each
# on the dev VM), and in the simulator 64 kept what 256 bought.
SHED_WINDOW = 64


def expected_outputs(view: ReqView, eos_share: float) -> float:
    """The outputs `shed` counts for a waiting request: its outputs left where known, else
    `eos_share` of their bound."""
    return view.outputs_left if view.outputs_known else eos_share * view.outputs_left


def shed(views: Iterable[ReqView], now: float, costs: StepCosts, chunk: int | None, decode_share_s: float,
         window: int, eos_share: float = 0.0) -> set[str]:
    """The rids of the viable waiting requests without a first token (`views`, earliest deadline
    first, the first `window` read) that leave the viable tier so that more of the others get their
    first token in time. Walking them in order, each kept one adds its prompt to the prefill ahead
    of the next and, where its outputs left are known (`ReqView.outputs_known`), its decoding's
    share of the device (`decode_share_s` per output token: a decode step over the running batch);
    when one would miss its deadline behind the work kept so far, the kept request with the most
    work per unit of its class weight (itself, possibly) is dropped (Moore and Hodgson's rule; the
    weight, as everywhere in the policy, says who wins when not everyone can), or the late one
    itself where dropping that one would not put it on time. A request of unknown
    length (one that may stop at EOS: its `outputs_left` is only the bound max_new_tokens sets)
    counts `eos_share` of that bound (`rotasched.output_share`; 0: its prompt only)."""
    out: set[str] = set()
    kept: list[tuple[float, int, ReqView]] = []  # heap: the most work per weight first, then the latest deadline
    tokens = 0
    outputs: float = 0
    for i, v in enumerate(itertools.islice(views, window)):
        known = expected_outputs(v, eos_share)
        tokens += v.prefill_tokens
        outputs += known
        work = costs.prefill_s_per_token * v.prefill_tokens + decode_share_s * known
        mine = (-work / v.weight, -i, v)
        heapq.heappush(kept, mine)
        deadline = v.arrival + v.ttft_slo
        if now + prefill_time_s(tokens, costs, chunk) + decode_share_s * (outputs - known) + costs.decode_step_s > deadline:
            top = heapq.heappop(kept)
            big = top[2]
            if big is not v:
                # Moore and Hodgson's one removal puts v on time only without weights and decode
                # shares (a kept request's decoding delays those behind it, not itself): where v
                # would still be late, v goes instead, and the kept ones stay as they were
                less = expected_outputs(big, eos_share)
                if now + prefill_time_s(tokens - big.prefill_tokens, costs, chunk) + \
                        decode_share_s * (outputs - known - less) + costs.decode_step_s > deadline:
                    heapq.heappush(kept, top)
                    kept.remove(mine)
                    heapq.heapify(kept)
                    big = v
            tokens -= big.prefill_tokens
            outputs -= expected_outputs(big, eos_share)
            out.add(big.rid)
    return out
