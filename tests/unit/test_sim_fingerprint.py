"""Speed work must not change results: pinned fingerprints of simulation runs.

The hashes were taken before the simulator and rotasched were optimised (2026-11-22) and cover
every policy and the LVF variants (no ignore_eos, min stint, mixed chunk, lookahead, small budget
with beta_tbt). A fingerprint covers every request's clock, every gap, the counters and the
summary, bit for bit (`superinfer_sgl/sim/fingerprint.py`). The full set, including the 120 s
speed runs, is checked with
`python -m superinfer_sgl.sim.fingerprint check results/sim_fingerprints_small.json` (and
`... results/sim_fingerprints_speed.json --cases speed`). If a deliberate behaviour change moves
them, re-pin from a run of the changed code and say why in the change.
Float results are bit-exact on one platform (x86-64 CPython 3.11 here), not across all.
"""

from __future__ import annotations

import pytest

from superinfer_sgl.sim.fingerprint import run_case, small_cases

PINNED = {
    "h100-pcie5-qwen2.5-32b/sglang/8": "de6ff1de1f7b79bd9b692d8dbf297f1c588abe627a189bf2b964796061d02b62",
    "h100-pcie5-qwen2.5-32b/sglang-priority/8": "d8dbea852f523cc5b6b5a7d505a04d0dbe00eb89271806d8f6fc4b840c3bc169",
    "h100-pcie5-qwen2.5-32b/vllm-swap-waiting-first/8": "8030e6438d50ef546617f8124d9d39e0714a16bd9e12a3c6536b6d807160e093",
    "h100-pcie5-qwen2.5-32b/vllm-swap-swapped-first/8": "c4616a27530727985aa1a947861ff143cc28802fc7bc267d24ae222ef17c8586",
    "h100-pcie5-qwen2.5-32b/lvf-naive/8": "d628366fba5881bfb80ee760de2118b58279ba3617376a8b0f028898b2596ebf",
    "h100-pcie5-qwen2.5-32b/lvf-batched/8": "6561c5b8fa7039afc8d194924f63ea0bdde0d261f1e32c22f1a936d875ac40bd",
    "h100-pcie5-qwen2.5-32b/lvf-duplex/8": "2bdf0607662aa44b874a6f66112f0e3a7ac10f4ee55299f2b82edaf3bccf868b",
    "h100-pcie5-qwen2.5-32b/lvf-naive-direct/8": "adc2ff6027fe9126b1c372288d3c6d89c384c0443089bc66739faf1b33a03ada",
    "h100-pcie5-qwen2.5-32b/lvf-duplex-direct/8": "720e9cbc72bfaf5ead24fe678696d5e18042e8ac24f3593b003c5a105ff41956",
    "h100-pcie5-qwen2.5-32b/oracle/8": "1a4fbb1abcdaa5efb7feebc4fc9d818265325a3b9d6c7a67986195f7d7a98741",
    "gh200-qwen2.5-32b/lvf-duplex/15": "e874eb777fcfadf56f2e98996d62174d2da981a54c72dff2c0d889f00c38348d",
    "h100/lvf-duplex/8/no-ignore-eos": "35372f13db6be3ba80c1249e20accfcd54ac0d80ddb1b63fca220cd58003d7ec",
    "h100/lvf-duplex/8/min-stint-2": "474e3b4a8d2010f99e29e84500386cacf3d6f01e1f18d5e61379ae018ab37050",
    "h100/lvf-duplex/8/mixed-chunk": "f2056a2416abbd2dae685b3d6fe794295161ccca0c142210369ae3496ef4d6a6",
    "h100/lvf-duplex/8/lookahead": "0889db7f208ed0448e12fd1a44fae6bae5211a992f2ae12a7e8a398578d03bd4",
    "h100/lvf-duplex/8/budget-300-beta1": "6c8a1706e21ea9804b5a484757e7d3d1d49039d2f2aa96750ed272cc0d69f150",
}
CASES = {c[0]: c for c in small_cases()}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_results_are_bit_identical_to_the_pinned_runs(name: str) -> None:
    fp, _, _ = run_case(CASES[name])
    assert fp == PINNED[name], name
