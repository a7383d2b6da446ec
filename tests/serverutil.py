"""Start and stop real servers for end-to-end tests (our launcher or stock SGLang)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

STARTUP_TIMEOUT_S = int(os.environ.get("SUPERINFER_TEST_STARTUP_S", "300"))  # more on a crowded machine


def free_port() -> int:
    """A free port: any, or one in SUPERINFER_TEST_PORTS ("LO-HI") on a machine shared by several
    test runs (SGLang also takes a few ports above the server's own)."""
    span = os.environ.get("SUPERINFER_TEST_PORTS")
    candidates = [0]
    if span:
        lo, hi = (int(x) for x in span.split("-"))
        candidates = random.sample(range(lo, hi + 1, 10), len(range(lo, hi + 1, 10)))
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in SUPERINFER_TEST_PORTS={span}")


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    children: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self, prefix: str = "superinfer_") -> dict[str, float]:
        """Prometheus text parsed into {series-with-labels: value} for series starting with prefix."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                key, value = line.rsplit(" ", 1)
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def sglang_gauge(self, name: str) -> float:
        """Sum of an SGLang gauge over its label sets (e.g. num_running_reqs)."""
        return sum(v for k, v in self.metrics("sglang:").items() if k.split("{")[0] == f"sglang:{name}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> list[int]:
        """Signal the launcher only (as a user's Ctrl-C would) and return pids left behind."""
        tree = self._tree()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.time() + 15
        while time.time() < deadline and any(psutil.pid_exists(p) and _alive(p) for p in tree):
            time.sleep(0.5)
        left = [p for p in tree if psutil.pid_exists(p) and _alive(p)]
        for p in left:  # never leak processes into the rest of the test session
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    def _tree(self) -> list[int]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


PORT_TRIES = 3  # a free port can be taken before the server binds it (another server's internal ports)
# The port was taken: found by our launcher's check (it exits 2), or after it, by uvicorn's bind
# (the launcher then hangs until the startup timeout).
PORT_TAKEN = ("is already in use (pick another with --port)", "error while attempting to bind on address")


def start_server(args: list[str], log_path: Path, *, stock: bool = False,
                 env: dict[str, str] | None = None, port: int | None = None) -> Server:
    """Start a server and wait until it has served SGLang's warmup request. A port picked here
    (`port` None) that another process took before the server bound it is picked again."""
    for attempt in range(PORT_TRIES):
        try:
            return _start_server(args, log_path, stock=stock, env=env, port=port)
        except RuntimeError as exc:
            if port is not None or not any(m in str(exc) for m in PORT_TAKEN) or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _start_server(args: list[str], log_path: Path, *, stock: bool,
                  env: dict[str, str] | None, port: int | None) -> Server:
    port = port or free_port()  # a given port: e.g. a restart where a crashed server served
    module = "sglang.launch_server" if stock else "superinfer_sgl.launch_server"
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    full_env = {**os.environ, **(env or {})}
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, port, log_path)
    deadline = time.time() + STARTUP_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None or PORT_TAKEN[1] in server.log():
            server.stop()  # the launcher may linger after its HTTP server failed to bind
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            ready = "ready to roll" in server.log()  # printed after SGLang's warmup request
            if ready and requests.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server did not start in {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")


def generate(server: Server, text: str, max_new_tokens: int = 24, **extra: object) -> dict:
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                            **extra.pop("sampling_params", {})},  # type: ignore[dict-item]
        **extra,
    }
    r = requests.post(server.url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()
