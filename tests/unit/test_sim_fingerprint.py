"""Speed work must not change results: pinned fingerprints of simulation runs.

The hashes cover every policy and the LVF variants (no ignore_eos, min stint 2 s, the paper's
rule without a rotation quantum, mixed chunk, lookahead, small budget with beta_tbt), and the
goodput policy with requests that may stop at EOS (decode shortages rotated out). A fingerprint
covers every request's clock, every gap, the counters and the summary, bit for bit
(`superinfer_sgl/sim/fingerprint.py`). The full set, including the 120 s speed runs, is checked with
`python -m superinfer_sgl.sim.fingerprint check results/sim_fingerprints_small.json` (and
`... results/sim_fingerprints_speed.json --cases speed`). A deliberate behaviour change that moves
them is re-pinned from a run of the changed code, saying in its commit which cases moved and why
(`git log -p` on this file and results/sim_fingerprints_*.json holds that history).
Float results are bit-exact on one platform (x86-64 CPython 3.11 here), not across all.
"""

from __future__ import annotations

import pytest

from superinfer_sgl.sim.fingerprint import run_case, small_cases

PINNED = {
    "h100-pcie5-qwen2.5-32b/sglang/8": "24aa4b8c0e983c438b93113cadabafc082c2df1a9dc477d0b598fd4385c49545",
    "h100-pcie5-qwen2.5-32b/sglang-priority/8": "993a000e1378db5ebc83705283898c1aab40f6ce997f59cf0121ff0903616df2",
    "h100-pcie5-qwen2.5-32b/vllm-swap-waiting-first/8": "866940cdc7fbba80fb122867c5eb15fbfa056dd9f068c014b7a87e05f9391b5a",
    "h100-pcie5-qwen2.5-32b/vllm-swap-swapped-first/8": "3c9698c1a6804fee92dc8ac45a7500bc953ca5e3a7b06b0a79bf67ef4262d7a1",
    "h100-pcie5-qwen2.5-32b/lvf-naive/8": "30bb0452cca82056a72e8eb0cf626c13024b6eaa771f6eaa08006db80f3d86d3",
    "h100-pcie5-qwen2.5-32b/lvf-batched/8": "6789d07a06d069cfab5f0e2dc3078dffba00b9b751b1faf3b31a4b2d24db365a",
    "h100-pcie5-qwen2.5-32b/lvf-duplex/8": "bc38699eee69e614893e94cbc8a2a7ac2a0bd95542c07c6213de0f369a9fbdb5",
    "h100-pcie5-qwen2.5-32b/lvf-naive-direct/8": "88caf8d2641d6021c5e3a43ad9f80a839375d32cb810092e0b2d1d7df63e036c",
    "h100-pcie5-qwen2.5-32b/lvf-duplex-direct/8": "abdec97efcdedd346cde6f5c83b79831200e92d3d8342b0dd01bdf00347dcceb",
    "h100-pcie5-qwen2.5-32b/oracle/8": "8fc9aefacc25b8fc3ea6e1bf5aabbb8d952b9a2350df6eb738546d44d29432c0",
    "gh200-qwen2.5-32b/lvf-duplex/15": "f12444ee6c6b3191b3af767f463f1d10de1d6d92b02abac82e81c450d8cd3b82",
    "h100/lvf-duplex/8/no-ignore-eos": "c2a7efabddea26194eb5d09685a894a1f8358ecb5d0d215baa797b9550570426",
    "h100/lvf-duplex/8/min-stint-2": "5240f5020846969ee5a1164eab667640149684cc47000275e8178d19883bc966",
    "h100/lvf-duplex/8/mixed-chunk": "87020d5cfb402150977ccdf32a76018ce28af77e7430e729bdc185050f6af894",
    "h100/lvf-duplex/8/lookahead": "7ec8d1d46c14eecf35c82d5ecb3efe3dda1b7cf32fe832ea31c4146940bc37af",
    "h100/lvf-duplex/8/budget-300-beta1": "18401e64fdb9746c15dc8533bdaccfc2f7171b3648cf5165be9629fe6831bffd",
    "h100/lvf-duplex/8/paper-rule": "eb287a3dcc9b2ea3f7b0cbe9a104892119f39d5e4b9008eb121ea16f2c8b98ff",
    "h100-pcie5-qwen2.5-32b/goodput/8": "a2caa89a4de279a1d689c05d504b2fddab31c2cb4ba01b25b635b49685dd7ff8",
    "gh200-qwen2.5-32b/goodput/15": "2483ac32fec319b306f4a82496cdda885d046213160994ca3799ec3565c6e46f",
    "h100-pcie5-qwen2.5-32b/paper/8": "5065384c6a5d9deadd5cefe7a98d6fad0fa43e1659624fcd3795c44d700455af",
    "h100/goodput/12/no-ignore-eos-mixed": "02e32f5772fc093b18bef1bd0aa2cf652bb0b61fcf975ceb19fef76158f230fd",
}
CASES = {c[0]: c for c in small_cases()}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_results_are_bit_identical_to_the_pinned_runs(name: str) -> None:
    fp, _, _ = run_case(CASES[name])
    assert fp == PINNED[name], name
