"""Speed work must not change results: pinned fingerprints of simulation runs.

The hashes cover every policy and the LVF variants (no ignore_eos, min stint 2 s, the paper's
rule without a rotation quantum, mixed chunk, lookahead, small budget with beta_tbt). First taken
before the speed work (2026-11-22, unchanged by it); re-pinned the same day for deliberate model
changes: the runtime's admission order, the rotation quantum as the default, no rotation right
after a mixed chunk, head-of-line LVF, idle resume, prefix cache and per-resume cost fields. A fingerprint covers every request's clock, every gap, the counters and the
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
    "h100-pcie5-qwen2.5-32b/lvf-naive/8": "1ac4286c8d025b618e5a4573943ba9380feb31c9e8e5f724446ffad1bc1ce7fe",
    "h100-pcie5-qwen2.5-32b/lvf-batched/8": "15d88068801d340707c4fcc27ae5c91116f1fc0a41d1f80ed02271bbbeaa8b86",
    "h100-pcie5-qwen2.5-32b/lvf-duplex/8": "a0cec4f4f00796a3be93dacd584d453f9986392ecd2cd17d1f0a01655fde9bb7",
    "h100-pcie5-qwen2.5-32b/lvf-naive-direct/8": "e131f183f426912b60dff22ca0116b02f70b424ec3b34622e9aedbfc5b9825bf",
    "h100-pcie5-qwen2.5-32b/lvf-duplex-direct/8": "2417a988080256d237dbb96bda085a176548222ebccd2f4c913222a2d8bdfda0",
    "h100-pcie5-qwen2.5-32b/oracle/8": "1a4fbb1abcdaa5efb7feebc4fc9d818265325a3b9d6c7a67986195f7d7a98741",
    "gh200-qwen2.5-32b/lvf-duplex/15": "13c331e005520cfb7677746c96efa447956c3e23fb9b8ad949ea8dccbf1050c4",
    "h100/lvf-duplex/8/no-ignore-eos": "a7a5f9449c1b4f501f5c30caf9cb62eaadd89d824593eda78c71457f6b0e1dc7",
    "h100/lvf-duplex/8/min-stint-2": "1351934f4d033eda8a8b5c1c0973d5129e21d02765422a0a7ad9292a3e47b426",
    "h100/lvf-duplex/8/mixed-chunk": "cdce3f553d5675d31164269e36a0d1e7c4962ed1c7ece7f8fbedbc23110e14b9",
    "h100/lvf-duplex/8/lookahead": "1f879cfb1937cd8ea883a7514f1e58a5181ea6d90aaef2e831bd44c03396d23a",
    "h100/lvf-duplex/8/budget-300-beta1": "61b06a1b31494b5c401c547d5f5e8ac54ae7149e9a1d41ef9aeec991fe71290d",
    "h100/lvf-duplex/8/paper-rule": "381f0ed42abadf8d527ab35d44ff98dceccf3241903de3fd997fb93bc6a9bbc5",
}
CASES = {c[0]: c for c in small_cases()}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_results_are_bit_identical_to_the_pinned_runs(name: str) -> None:
    fp, _, _ = run_case(CASES[name])
    assert fp == PINNED[name], name
