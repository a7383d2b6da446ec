"""The load generator: SGLang's own `sglang.benchmark.serving`, with our arrival schedule.

bench_serving draws Poisson gaps itself and replays timestamps only for the mooncake dataset
through its `sglang` backend, whose flat request body cannot carry per-request SLOs to /generate.
So we run its unmodified CLI (`cli_main`: same request functions, dataset loader, streaming
client, --output-details) in a child process with two substitutions:
  - `get_request` yields request i at t0 + arrivals[i] from a schedule file we wrote (Poisson
    from the seed, or trace timestamps): both systems get byte-identical schedules;
  - its progress bar prints one marker line per finished request, which the parent turns into a
    tqdm bar of its own.

Child: python -m superinfer_sgl.bench.client --ab-schedule FILE -- <bench_serving arguments>
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROGRESS_MARK = "@@ab-progress"


# ---- child side --------------------------------------------------------------------------------
def scheduled_get_request(arrivals: Sequence[float]) -> Callable[..., AsyncIterator[Any]]:
    async def get_request(input_requests: list, request_rate: float, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        if len(input_requests) != len(arrivals):
            raise RuntimeError(f"schedule has {len(arrivals)} arrivals for {len(input_requests)} requests")
        t0 = time.perf_counter()
        for req, at in zip(input_requests, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            yield req

    return get_request


class ProgressLines:
    """Stands in for bench_serving's tqdm: one stdout line per finished request."""

    def __init__(self, total: int = 0, **_: Any) -> None:
        self.total, self.n = total, 0
        print(f"{PROGRESS_MARK} 0 {total}", flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"{PROGRESS_MARK} {self.n} {self.total}", flush=True)

    def close(self) -> None:
        pass


def _without_datasets() -> None:
    """bench_serving imports every dataset loader, and its MMMU one imports Hugging Face `datasets`
    at module level; the GPU machine has no `datasets`, and our runs read the openai dataset only.
    Where it is missing, a module whose load_dataset says so stands in."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        def load_dataset(*_: Any, **__: Any) -> Any:
            raise RuntimeError("Hugging Face `datasets` is not installed; the A/B's load generator reads "
                               "the openai dataset only")

        stand_in = types.ModuleType("datasets")
        stand_in.load_dataset = load_dataset  # type: ignore[attr-defined]
        sys.modules["datasets"] = stand_in


def child_main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "--ab-schedule" or argv[2] != "--":
        raise SystemExit("usage: python -m superinfer_sgl.bench.client --ab-schedule FILE -- <bench_serving args>")
    arrivals = json.loads(Path(argv[1]).read_text())["arrivals_s"]
    _without_datasets()
    from sglang.benchmark import serving

    serving.get_request = scheduled_get_request(arrivals)
    serving.tqdm = ProgressLines
    sys.argv = ["sglang.benchmark.serving", *argv[3:]]
    serving.cli_main()


# ---- parent side -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientRun:
    """One bench_serving run against one server; `details` is its --output-details record."""

    args: list[str]
    details: dict[str, Any]
    wall_s: float


class ClientError(RuntimeError):
    pass


def bench_args(base_url: str, dataset: Path, n: int, seed: int, out_file: Path, tokenizer: str,
               backend: str = "sglang-oai-chat", ignore_eos: bool = True) -> list[str]:
    """bench_serving arguments; --request-rate is informational (the schedule file decides).
    `ignore_eos` False: requests may stop at EOS (bench_serving sends ignore_eos per its flag)."""
    return [
        "--backend", backend, "--base-url", base_url, "--dataset-name", "openai",
        "--dataset-path", str(dataset), "--num-prompts", str(n), "--tokenizer", tokenizer,
        "--seed", str(seed), "--output-file", str(out_file), "--output-details",
        "--warmup-requests", "1", "--flush-cache", "--ready-check-timeout-sec", "60",
        *(() if ignore_eos else ("--disable-ignore-eos",)),
    ]


def run_client(args: list[str], schedule: Path, log_path: Path, out_file: Path,
               on_progress: Callable[[int, int], None] | None = None, timeout_s: float = 3600,
               cores: frozenset[int] | None = None) -> ClientRun:
    """Run the load generator to the end (on `cores` only, if given: paired mode)."""
    cmd = [sys.executable, "-m", "superinfer_sgl.bench.client", "--ab-schedule", str(schedule), "--", *args]
    out_file.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        if cores:  # pinned from here, not in a preexec_fn: two harness threads start clients at once
            try:
                os.sched_setaffinity(proc.pid, cores)  # before its interpreter starts any thread
            except OSError:
                pass  # already exited: its output says why
        watchdog = threading.Timer(timeout_s, proc.kill)  # a hung run must not hang the sweep
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(PROGRESS_MARK):
                    done, total = (int(x) for x in line.split()[1:3])
                    if on_progress is not None:
                        on_progress(done, total)
                    continue
                log.write(line)
            rc = proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if time.monotonic() - start >= timeout_s:
        raise ClientError(f"load generator killed after {timeout_s:.0f}s; see {log_path}")
    if rc != 0 or not out_file.is_file():
        raise ClientError(f"load generator failed (rc={rc}); see {log_path}:\n{_tail(log_path)}")
    lines = [l for l in out_file.read_text().splitlines() if l.strip()]
    return ClientRun(args, json.loads(lines[-1]), time.monotonic() - start)


def _tail(path: Path, chars: int = 2500) -> str:
    return path.read_text(errors="replace")[-chars:]


if __name__ == "__main__":
    child_main(sys.argv[1:])
