"""Shared fixtures: the prepared default model and real servers, started once per session.

End-to-end tests compare greedy token ids in float32 (batching changes bf16 numerics on CPU, with
or without preemption), against stock SGLang scheduling serving each request alone.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serverutil import Server, start_server  # noqa: E402

# Small KV budget and chunk size so concurrent requests share the radix tree and prefill in chunks.
COMMON = ["--dtype", "float32", "--max-total-tokens", "4096", "--chunked-prefill-size", "64",
          "--enable-metrics", "--log-level", "info"]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from superinfer_sgl.model_prep import prepare_default_model

    return prepare_default_model()


def _server(tmp_path_factory: pytest.TempPathFactory, name: str, args: list[str], **kw: object) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / f"{name}.log"
    server = start_server(args, log, **kw)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        left = server.stop()
        assert not left, f"{name}: processes left after shutdown: {left}"


@pytest.fixture(scope="session")
def stock_sched_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Our launcher with SGLang's stock scheduling (the A side of A/B)."""
    yield from _server(tmp_path_factory, "stock_sched", ["--scheduler", "sglang", *COMMON])


@pytest.fixture(scope="session")
def stock_sched_server_no_overlap(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same without the overlap scheduler: the reference of `rota_server_no_overlap` where SGLang's
    two loops differ (its penalties count the outputs one step later under overlap)."""
    yield from _server(tmp_path_factory, "stock_sched_no_overlap",
                       ["--scheduler", "sglang", "--disable-overlap-schedule", *COMMON])


@pytest.fixture(scope="session")
def rota_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """RotaSched with forced rotations every 3 iterations, overlap scheduler on (SGLang default),
    eager sync on (off by default on CPU: this keeps its path under the lossless checks)."""
    env = {"SUPERINFER_TEST_ROTATE_INTERVAL": "3", "SUPERINFER_VERIFY_ROTATION": "1"}
    yield from _server(tmp_path_factory, "rota", [*COMMON, "--eager-sync"], env=env)


@pytest.fixture(scope="session")
def rota_server_no_overlap(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"SUPERINFER_TEST_ROTATE_INTERVAL": "2", "SUPERINFER_VERIFY_ROTATION": "1",
           "SUPERINFER_TEST_HOLD_ROTARY_ITERS": "6"}
    # --mix-prefill needed: prefills the policy runs alone stay under the same lossless checks
    yield from _server(tmp_path_factory, "rota_no_overlap", [*COMMON, "--disable-overlap-schedule",
                                                              "--mix-prefill", "needed"], env=env)
