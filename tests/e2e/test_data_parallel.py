"""`--dp-size 2` on CPU: SGLang's DP controller with two scheduler ranks, each running RotaSched with
its own host pool; the startup handshake checks both ranks; headroom gauges per dp_rank."""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path
from typing import Iterator

import pytest

from serverutil import Server, generate, start_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dp_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPU cores: one per DP rank")
    # SGLang on CPU binds each rank to a NUMA node unless told which cores to use; our launcher
    # splits this process's cores between the ranks when the user did not (device_defaults).
    log = tmp_path_factory.mktemp("logs") / "dp.log"
    with pytest.MonkeyPatch.context() as mp:  # the launcher's own binding is under test
        mp.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
        server = start_server(["--dp-size", "2", "--max-total-tokens", "2048", "--rotary-pool-gb", "0.25",
                               "--enable-metrics"], log)
    try:
        yield server
    finally:
        left = server.stop()
        assert not left, f"processes left after shutdown: {left}"


def test_both_ranks_run_rotasched_and_report_per_rank(dp_server: Server) -> None:
    log = dp_server.log()
    # SGLang's own line when the binding is set: the launcher set it (the fixture unset the caller's)
    assert "SGLANG_CPU_OMP_THREADS_BIND is set for explicit control" in log
    assert "DP0] superinfer: host rotary pool" in log and "DP1] superinfer: host rotary pool" in log
    params = {"custom_params": {"slo_class": "interactive"}}
    with cf.ThreadPoolExecutor(6) as pool:
        out = list(pool.map(lambda i: generate(dp_server, f"Story {i}: once upon a time", 12,
                                               sampling_params=params), range(6)))
    assert {r["meta_info"]["dp_rank"] for r in out} == {0, 1}
    assert all(r["meta_info"]["superinfer"]["superinfer_slo_class"] == "interactive" for r in out)
    m = dp_server.metrics()
    for rank in ("0", "1"):
        assert f'superinfer_queue_vlt_max_seconds{{dp_rank="{rank}"}}' in m
        judged = sum(v for k, v in m.items() if k.startswith("superinfer_slo_recent_requests{")
                     and f'dp_rank="{rank}"' in k and 'slo_class="interactive"' in k and 'slo="ttft"' in k)
        assert judged >= 1, (rank, m)
