"""Stock `python -m sglang.launch_server` in the same venv: serves on CPU with only the
CPU-compatibility switch, and our installed plugin stays inert (the A/B baseline) except for the
CPU patches that switch turns on (rotary fallback, batched CPU attention: equal attention speed on
both sides of an A/B)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from serverutil import Server, generate, start_server

pytestmark = pytest.mark.e2e

CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--cuda-graph-backend-decode",
             "disabled", "--cuda-graph-backend-prefill", "disabled", "--max-total-tokens", "4096",
             "--dtype", "float32", "--sleep-on-idle"]


@pytest.fixture(scope="module")
def stock_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "stock.log"
    server = start_server(["--model-path", str(model_dir), *CPU_FLAGS], log, stock=True,
                          env={"SUPERINFER_CPU_COMPAT": "1", "SUPERINFER_SGL_CONFIG": ""})
    yield server
    assert not server.stop()


def test_stock_sglang_serves_on_cpu_with_plugin_inert(stock_server: Server,
                                                      stock_sched_server: Server) -> None:
    prompt = "List the planets of the solar system in order from the sun:"
    resp = generate(stock_server, prompt, max_new_tokens=16)
    assert "superinfer" not in resp["meta_info"]  # none of our hooks ran
    assert "superinfer: host rotary pool" not in stock_server.log()  # no RotaSched runtime
    assert "superinfer cpu attention active" in stock_server.log()  # SUPERINFER_CPU_COMPAT=1 turns it on
    assert "superinfer cpu attention active" in stock_sched_server.log()  # our launcher's CPU default
    ours = generate(stock_sched_server, prompt, max_new_tokens=16)
    assert resp["output_ids"] == ours["output_ids"]
