"""Our CPU attention in a real server: greedy output ids equal stock torch_native's (float32).

Two servers from our launcher with SGLang's scheduler (`--scheduler sglang`), identical but for
SUPERINFER_CPU_ATTENTION (1: our backend, 0: stock torch_native); they start concurrently to
keep the test near two minutes. Prompts are served one at a time; the second round repeats
prompts with a continuation so the radix cache turns them into prefix + extend prefills.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from serverutil import Server, generate, start_server

pytestmark = [
    pytest.mark.e2e,
]

ACTIVE_LINE = "superinfer cpu attention active"
FLAGS = ["--dtype", "float32", "--attention-backend", "torch_native", "--max-total-tokens", "4096",
         "--scheduler", "sglang", "--log-level", "info"]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List the planets of the solar system in order from the sun, with one fact about each planet, "
    "its distance from the sun, its number of moons, and whether a spacecraft has visited it. " * 3,
]
FOLLOW_UPS = [p + " Answer in one short paragraph." for p in PROMPTS[:2]]


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("cpu_attention_logs")

    def launch(name: str, enabled: str) -> Server:
        env = {"SUPERINFER_CPU_ATTENTION": enabled, "SUPERINFER_CPU_ATTENTION_KERNEL": "auto"}
        return start_server(["--model-path", str(model_dir), *FLAGS], logs / f"{name}.log", env=env)

    with ThreadPoolExecutor(2) as pool:  # leaving the block waits for both starts
        futures = [pool.submit(launch, "superinfer", "1"), pool.submit(launch, "torch_native", "0")]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        yield started[0], started[1]
    finally:
        left = [p for s in started for p in s.stop()]
        assert not left, f"processes left after shutdown: {left}"


def test_backend_is_live_only_where_enabled(servers: tuple[Server, Server]) -> None:
    ours, stock = servers
    assert ACTIVE_LINE in ours.log(), "our backend did not load in the scheduler (plugin not wired?)"
    assert ACTIVE_LINE not in stock.log()


@pytest.mark.parametrize("prompt", PROMPTS + FOLLOW_UPS, ids=lambda p: p[:20])
def test_greedy_ids_equal_torch_native(servers: tuple[Server, Server], prompt: str) -> None:
    ours, stock = servers
    expected = generate(stock, prompt, max_new_tokens=32)
    got = generate(ours, prompt, max_new_tokens=32)
    assert got["output_ids"] == expected["output_ids"]
    assert got["meta_info"]["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
