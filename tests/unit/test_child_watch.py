"""The launcher's child watchdog without a server: a multiprocessing child titled like SGLang's
scheduler is killed; the watch must name it and its signal, remove the shared-memory segment the
tree held, and exit with EXIT_CHILD_DIED; a child that exits 0 (SGLang's own shutdown) must not
trigger it. The end-to-end version (a real scheduler and detokenizer) is tests/e2e/test_crash.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from superinfer_sgl.child_watch import EXIT_CHILD_DIED, ChildWatch, describe_exit, describe_role


def test_roles_and_exits_are_named() -> None:
    assert describe_role("sglang::scheduler") == "scheduler (TP0)"
    assert describe_role("sglang::scheduler_DP1_TP2") == "scheduler (DP1 TP2)"
    assert describe_role("sglang::detokenizer") == "detokenizer"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-11) == "killed by SIGSEGV"
    assert describe_exit(3) == "exit status 3"
    assert describe_exit(None) == "exit status unknown"


def _child(title: str, seconds: float, code: int) -> None:
    import setproctitle

    setproctitle.setproctitle(title)
    time.sleep(seconds)
    os._exit(code)


def _watch(exits: list[int]) -> ChildWatch:
    return ChildWatch(poll_s=0.05, state=lambda: (True, False), exit=exits.append)


SCRIPT = """
import multiprocessing, os, sys, time
from multiprocessing import shared_memory

def child():
    import setproctitle
    setproctitle.setproctitle("sglang::scheduler_TP1")
    time.sleep(120)

if __name__ == "__main__":
    from superinfer_sgl.child_watch import ChildWatch
    proc = multiprocessing.get_context("spawn").Process(target=child)
    proc.start()
    segment = shared_memory.SharedMemory(create=True, size=4096)  # held (mapped) by this tree
    watch = ChildWatch(poll_s=0.05, state=lambda: (True, False))
    watch.start()
    while not watch.tracked or not watch.files:  # the child sets its title; the first rescan ran
        time.sleep(0.05)
    print("ready", proc.pid, segment.name, flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(90)
def test_a_killed_child_is_named_and_its_segment_removed(tmp_path: Path) -> None:
    """In a process of its own: the watch kills that process's tree and ends it with os._exit."""
    pytest.importorskip("setproctitle")
    script = tmp_path / "launcher.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()  # type: ignore[union-attr]
        assert line and line[0] == "ready", proc.stderr.read()  # type: ignore[union-attr]
        pid, name = int(line[1]), line[2]
        assert os.path.exists(f"/dev/shm/{name}")
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        rc = proc.wait(timeout=20)
        took = time.monotonic() - t0
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert rc == EXIT_CHILD_DIED, err
        assert took < 5, took
        assert f"the scheduler (TP1) process (pid {pid}) died, killed by SIGKILL" in err, err
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_a_clean_exit_is_a_shutdown_not_a_crash() -> None:
    pytest.importorskip("setproctitle")
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_child, args=("sglang::detokenizer", 3, 0))
    child.start()
    exits: list[int] = []
    watch = _watch(exits)
    deadline = time.time() + 20
    while not watch.tracked:
        watch._track()
        assert time.time() < deadline, "the child never showed its title"
        time.sleep(0.1)
    watch.start()
    child.join(timeout=20)
    watch.join(timeout=5)
    assert not watch.is_alive() and exits == [] and watch.fired is None
