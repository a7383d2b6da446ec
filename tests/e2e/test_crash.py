"""Crashes (issue 38): SIGKILL of the scheduler while requests are parked in host memory (forced
rotations, load in flight), and of the detokenizer. The launcher must notice within seconds, exit
with status 4 and a line naming the dead process and its signal, and leave nothing behind: no
process of its tree, none of the shared-memory segments or ipc socket files its processes held,
and its port free. A restarted server must serve; its SIGTERM is still a clean exit (status 0, no
crash line) that also removes its segments. Stock SGLang's own handling (for comparison, in
docs/reliability.md): 6 s and exit -9 for the scheduler; for the detokenizer, still serving a
hung port after 60 s (py-spy, then a 60 s wait for CUDA coredumps); every segment left.
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from serverutil import Server, start_server

from superinfer_sgl.child_watch import EXIT_CHILD_DIED, owned_files
from superinfer_sgl.launch_checks import LaunchError, check_port_free

pytestmark = pytest.mark.e2e

ARGS = ["--dtype", "float32", "--max-total-tokens", "2048", "--chunked-prefill-size", "64",
        "--enable-metrics", "--log-level", "info"]
# A forced rotation every 2 iterations, each parked request held 6 iterations: always some rotary.
ENV = {"SUPERINFER_TEST_ROTATE_INTERVAL": "2", "SUPERINFER_TEST_HOLD_ROTARY_ITERS": "6"}
EXIT_WITHIN_S = 15.0  # SGLang alone: 6 s (scheduler), over 60 s (detokenizer)


def _held(tree: list[psutil.Process]) -> set[str]:
    """What the tree holds that must not outlive it: its shared-memory segments and socket files,
    and the files it maps in a temporary folder (SGLang's Prometheus multiprocess .db files)."""
    files = owned_files(tree)
    tmp = Path(tempfile.gettempdir())
    for p in tree:
        for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and Path(parts[5]).parent.parent == tmp and Path(parts[5]).parent.name.startswith("tmp"):
                files.add(parts[5])
    return files


def _tree(server: Server) -> list[psutil.Process]:
    root = psutil.Process(server.proc.pid)
    return [root, *root.children(recursive=True)]


def _victim(server: Server, title: str) -> psutil.Process:
    found = [p for p in _tree(server) if " ".join(p.cmdline()).startswith(title)]
    assert len(found) == 1, [(p.pid, p.cmdline()) for p in _tree(server)]
    return found[0]


def _gauge(server: Server, name: str) -> float:
    return sum(v for k, v in server.metrics().items() if k.split("{")[0] == name)


def _load(server: Server, stop: threading.Event) -> list[threading.Thread]:
    """Six clients sending long-output requests until stopped (or the server is gone)."""
    def client(k: int) -> None:
        while not stop.is_set():
            try:
                requests.post(server.url + "/generate", timeout=120, json={
                    "text": f"Client {k}: tell me a long story about the sea.",
                    "sampling_params": {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}})
            except requests.RequestException:
                return
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    return threads


def _port_free(port: int) -> bool:
    """As the launcher checks it (SO_REUSEADDR: the dead server's connections in TIME_WAIT do not
    count); the restart on the same port checks it for real."""
    try:
        check_port_free("127.0.0.1", port)
    except LaunchError:
        return False
    return True


def _left_behind(pids: list[int], files: set[str], port: int) -> dict[str, object]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return {"processes": alive, "files": sorted(f for f in files if Path(f).exists()),
            "port_in_use": not _port_free(port)}


def _kill_mid_rotation(tmp_path: Path, title: str, name: str) -> int:
    """Returns the dead server's port, for the restart."""
    server = start_server(ARGS, tmp_path / f"{title.split('::')[1]}.log", env=ENV)
    stop = threading.Event()
    try:
        threads = _load(server, stop)
        deadline = time.time() + 120
        while _gauge(server, "superinfer_rotary_requests") < 1:  # mid-rotation: requests parked
            assert time.time() < deadline, "no request was ever parked in host memory"
            time.sleep(0.1)
        tree = _tree(server)
        files = _held(tree)
        assert any(f.startswith("/dev/shm/") for f in files) and any(f.endswith(".db") for f in files), files
        victim = _victim(server, title)
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        try:
            rc = server.proc.wait(EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        stop.set()
        time.sleep(0.5)
        left = _left_behind([p.pid for p in tree], files, server.port)
        log = server.log()
        print(f"{name}: exit {rc} after {took:.1f} s; left: {left}")
        assert rc == EXIT_CHILD_DIED, f"exit {rc} after {took:.1f} s\n{log[-3000:]}"
        assert f"process (pid {victim.pid}) died, killed by SIGKILL" in log, log[-3000:]
        assert f"the {name} process" in log, log[-3000:]
        assert left == {"processes": [], "files": [], "port_in_use": False}, left
        for t in threads:
            t.join(timeout=30)
    finally:
        stop.set()
        server.stop(signal.SIGKILL)
    return server.port


def _restart_serves_and_stops_cleanly(tmp_path: Path, name: str, port: int) -> None:
    server = start_server(ARGS, tmp_path / f"{name}_restart.log", env=ENV, port=port)
    try:
        r = requests.post(server.url + "/generate", timeout=120, json={
            "text": "After the crash:", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 8, r.text
        tree = _tree(server)
        files = _held(tree)
    finally:
        left_pids = server.stop(signal.SIGTERM)
    log = server.log()
    assert server.proc.returncode == 0 and not left_pids, (server.proc.returncode, left_pids, log[-3000:])
    assert "superinfer_sgl: error" not in log, log[-3000:]  # a shutdown is no crash
    assert _left_behind([p.pid for p in tree], files, server.port)["files"] == []


def test_scheduler_killed_mid_rotation(model_dir: Path, tmp_path: Path) -> None:
    port = _kill_mid_rotation(tmp_path, "sglang::scheduler", "scheduler (TP0)")
    _restart_serves_and_stops_cleanly(tmp_path, "scheduler", port)


def test_detokenizer_killed_under_load(model_dir: Path, tmp_path: Path) -> None:
    port = _kill_mid_rotation(tmp_path, "sglang::detokenizer", "detokenizer")
    _restart_serves_and_stops_cleanly(tmp_path, "detokenizer", port)
