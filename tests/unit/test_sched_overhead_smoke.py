"""The scheduler overhead benchmark runs end to end on a small state (no timing is checked): our
hook and stock SGLang's get_new_batch_prefill on the same real SGLang requests, a contended
decision that moves nobody, and a JSON document that says which CPU ran it."""

from __future__ import annotations

import json
from pathlib import Path

from superinfer_sgl.bench import rundoc, sched_overhead
from superinfer_sgl.bench.sched_rig import build
from superinfer_sgl.model_prep import prepare_default_model


def test_rig_steady_state_and_document(tmp_path: Path) -> None:
    rig = build(80, "goodput", 1024, str(prepare_default_model()))
    try:
        queue = list(rig.sched.waiting_queue)
        for _ in range(3):
            rig.decode()
            assert rig.ours() is not None and rig.stock() is not None
        d = rig.rt._decision
        assert d.contention and d.is_noop and d.blocked is not None  # nobody fits, nobody moves
        assert rig.sched.waiting_queue == queue and len(rig.rt.store.entries) == rig.counts["rotary"] == 8
    finally:
        rig.context.close()
    out = tmp_path / "so.json"
    sched_overhead.main(["--counts", "40", "--steps", "2", "--warmup", "1", "--repeats", "1",
                         "--policy", "paper", "--out", str(out)])
    doc = json.loads(out.read_text())
    row = doc["rows"][0]
    assert row["requests"] == 40 and set(row["pooled"]) == {"ours", "stock"}
    assert doc["code"]["package"].endswith("superinfer_sgl") and row["last_decision"]["contention"]
    assert set(doc["machine_start"]["isa"]) <= set(rundoc.ISA_FLAGS)  # which CPU ran it


def test_cpu_info_reads_the_model_and_the_extensions_that_set_its_speed() -> None:
    core = "processor\t: {n}\nmodel name\t: {model}\nflags\t\t: fpu sse2 avx2 {extra}\n"
    amd = "\n".join(core.format(n=n, model="AMD EPYC", extra="avx512f_fake") for n in range(2))
    assert rundoc.cpu_info(amd) == {"cpu": "AMD EPYC", "isa": ["avx2"]}  # (whole flags, not prefixes)
    intel = core.format(n=0, model="Intel(R) Xeon(R) Processor", extra="avx512f avx512_bf16 amx_bf16 amx_tile")
    assert rundoc.cpu_info(intel) == {"cpu": "Intel(R) Xeon(R) Processor",
                                      "isa": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]}
    assert rundoc.cpu_info("")["isa"] == []  # no /proc/cpuinfo: the name from `platform`, no flags
