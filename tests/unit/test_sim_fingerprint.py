"""Speed work must not change results: pinned fingerprints of simulation runs.

The hashes cover every policy and the LVF variants (no ignore_eos, min stint 2 s, the paper's
rule without a rotation quantum, mixed chunk, lookahead, small budget with beta_tbt). First taken
before the speed work (2026-11-22, unchanged by it); re-pinned the same day for deliberate model
changes: the runtime's admission order, the rotation quantum as the default, no rotation right
after a mixed chunk, head-of-line LVF, idle resume, prefix cache and per-resume cost fields; re-pinned 2026-11-23 for the H100 profile's
link and step, now measured on our GPU machine (scripts/profile_from_gpu.py). A fingerprint covers every request's clock, every gap, the counters and the
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
    "h100-pcie5-qwen2.5-32b/sglang/8": "5032c7f56bbd4f2182fa5d9c52632f373dd77895c6cc18a119236b8a77506141",
    "h100-pcie5-qwen2.5-32b/sglang-priority/8": "927423fb360db011184fdaea34bb41db4ebac5e09c362b150f9e887c7ee4866d",
    "h100-pcie5-qwen2.5-32b/vllm-swap-waiting-first/8": "ee4f486578a6393fda7ff5fb31d11b47633564a3fad86b1c5ac30935f7a43f12",
    "h100-pcie5-qwen2.5-32b/vllm-swap-swapped-first/8": "0a9c25bfaf5eba7f80ac56101ab07448ad1af1288f58be9d232cb99c580f4ce7",
    "h100-pcie5-qwen2.5-32b/lvf-naive/8": "c0c9f8e8ab1b818c761f48fa2665d9eee2aabbca9d9d93e69fd214622e7306d4",
    "h100-pcie5-qwen2.5-32b/lvf-batched/8": "d63aca03a19336e2ad6cab49996777ce267dadb39977f777b29f2e281c9ad6da",
    "h100-pcie5-qwen2.5-32b/lvf-duplex/8": "e4d9c64d029da58af291d2f4a6cd1738396dd5410d487dca9beaa8661520d6cb",
    "h100-pcie5-qwen2.5-32b/lvf-naive-direct/8": "edaaa4c62bd872ca0ce70be2b3c0f7da0b6c9b0c0831c99c2a451c97a91586b1",
    "h100-pcie5-qwen2.5-32b/lvf-duplex-direct/8": "96a48a3ddc1cd8e63a3a2dd1a224eaa7ec71f6eb874ff27c3ab7f3b64b7dd0d8",
    "h100-pcie5-qwen2.5-32b/oracle/8": "7c46c86f16a407465424d045149ef638de48fd88b88bfcae84d4d531fd153cf3",
    "gh200-qwen2.5-32b/lvf-duplex/15": "13c331e005520cfb7677746c96efa447956c3e23fb9b8ad949ea8dccbf1050c4",
    "h100/lvf-duplex/8/no-ignore-eos": "94e5b11186ff123b9a298946fa49844d3d1ef930b02b80a4013b7eaa8f0e2def",
    "h100/lvf-duplex/8/min-stint-2": "5d4e072ac8c9bec3da076429d30bac009ddcec9e0af2fead5e9363680bda63fb",
    "h100/lvf-duplex/8/mixed-chunk": "a0e80e7b303896c0d242097f9ebc08c781d742bb0330f7849751953a9bc4a0d2",
    "h100/lvf-duplex/8/lookahead": "78bcf546b9058ab5525655f59ed376b15e8e700acddb40354d499f81c0f610bd",
    "h100/lvf-duplex/8/budget-300-beta1": "b52debde4b8f0b4abcc5fae03b3000dba530ada851495039b8e30e22fe401f53",
    "h100/lvf-duplex/8/paper-rule": "94753ef561a29130e895cf1e858fc0cda8026a76d8b404d2e799a1d659e0bcc7",
}
CASES = {c[0]: c for c in small_cases()}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_results_are_bit_identical_to_the_pinned_runs(name: str) -> None:
    fp, _, _ = run_case(CASES[name])
    assert fp == PINNED[name], name
