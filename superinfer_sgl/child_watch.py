"""Launcher-side watchdog: a dead scheduler or detokenizer ends the server within a second or two,
with a message naming the process and its signal, no process, shared-memory segment or socket
file left behind, and a non-zero exit (issue 38).

SGLang 0.5.23 notices a dead child itself (`SubprocessWatchdog`, a 1 s poll, then SIGQUIT to the
launcher), but its handler then sleeps 5 s for crash diagnostics, runs py-spy on the schedulers
still alive and, when one is (a dead detokenizer), waits 60 s "for CUDA coredumps" (on a CPU too),
while the HTTP port keeps accepting requests that can never finish. It then SIGKILLs its own
process (exit status -9) and, like every SGLang shutdown, leaves its POSIX shared memory
(`/dev/shm/sglang_loads_*`, multiprocessing's `sem.mp-*` once the resource tracker is killed) and
its ZMQ ipc socket files behind (and, killed, its Prometheus multiprocess folder). This thread
polls faster than SGLang's, acts first, and cleans up what our process tree had mapped or bound;
the graceful path (SIGTERM) uses `cleanup` too.

Standing down: nothing is armed before the server is ready (a failed start keeps SGLang's own
error), and a child that exits with status 0, or any exit once SGLang's graceful shutdown has begun
or the launcher is stopping, is a shutdown, not a crash.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

logger = logging.getLogger("superinfer_sgl")

EXIT_CHILD_DIED = 4  # launch_server's exit status when a server process died
SHM_DIR = "/dev/shm/"
RESCAN_EVERY = 40  # polls between rescans of the tree's segments and sockets (made at startup)


def describe_role(title: str) -> str:
    """'sglang::scheduler_DP1_TP2' -> 'scheduler (DP1 TP2)'; 'sglang::scheduler' -> 'scheduler
    (TP0)' (SGLang adds rank suffixes only past one rank); 'sglang::detokenizer' -> 'detokenizer'."""
    name = title.split()[0].removeprefix("sglang::") if title.strip() else "?"
    if name.startswith("scheduler"):
        ranks = name[len("scheduler"):].strip("_").replace("_", " ")
        return f"scheduler ({ranks or 'TP0'})"
    return name


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()  # the full title: comm is cut at 15 characters
    except psutil.Error:
        return "?"


def owned_files(procs: list[psutil.Process]) -> set[str]:
    """Shared-memory segments the processes map or hold open, and unix socket files they bound."""
    found: set[str] = set()
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = parts[5] if len(parts) == 6 else ""
                if path.startswith(SHM_DIR) and not path.endswith("(deleted)"):  # unlinked: not ours to name
                    found.add(path)
            for fd in os.listdir(f"/proc/{p.pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(SHM_DIR) and not target.endswith("(deleted)"):
                    found.add(target)
            for conn in p.net_connections(kind="unix"):
                if isinstance(conn.laddr, str) and conn.laddr.startswith("/"):
                    found.add(conn.laddr)
        except (OSError, psutil.Error):
            continue
    return found


def unlink_all(paths: set[str]) -> list[str]:
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # already gone, or not ours to remove
            pass
    return removed


def kill_tree(root: psutil.Process, timeout: float = 10.0) -> list[int]:
    """SIGKILL every descendant of `root` and wait for them; the pids still alive after."""
    try:
        procs = root.children(recursive=True)
    except psutil.Error:
        return []
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive]


def _remove_metrics_dir() -> list[str]:
    """SGLang's Prometheus multiprocess folder (a TemporaryDirectory of mmapped .db files, removed
    at a normal interpreter exit, which os._exit skips)."""
    common = sys.modules.get("sglang.srt.utils.common")  # not loaded: no folder (and no slow import)
    folder = getattr(common, "prometheus_multiproc_dir", None)
    if not isinstance(folder, tempfile.TemporaryDirectory) or not os.path.isdir(folder.name):
        return []
    shutil.rmtree(folder.name, ignore_errors=True)
    return [folder.name]


def _sglang_state() -> tuple[bool, bool]:
    """(ready, shutting down) of SGLang's HTTP server in this process."""
    try:
        from sglang.srt.entrypoints import http_server

        manager = http_server._global_state.tokenizer_manager  # type: ignore[union-attr]
    except (ImportError, AttributeError):
        return False, False
    status = getattr(getattr(manager, "server_status", None), "value", None)
    return status == "Up", bool(getattr(manager, "gracefully_exit", False))


class ChildWatch(threading.Thread):
    """Polls the launcher's child processes every `poll_s` seconds once the server is ready."""

    def __init__(self, poll_s: float = 0.25, state: Callable[[], tuple[bool, bool]] = _sglang_state,
                 exit: Callable[[int], None] = os._exit) -> None:
        super().__init__(daemon=True, name="superinfer-child-watch")
        self.poll_s, self.state, self.exit = poll_s, state, exit
        self.stopping = threading.Event()  # set by the launcher before its own teardown
        self.me = psutil.Process()
        self.files: set[str] = set()
        self.tracked: dict[int, tuple[str, multiprocessing.process.BaseProcess | None]] = {}
        self.fired: str | None = None

    def run(self) -> None:
        try:
            self._watch()
        except Exception:  # a broken watch must not pass silently; SGLang's own watchdog remains
            logger.exception("superinfer_sgl: the child watchdog stopped")

    def _watch(self) -> None:
        armed, polls = False, 0
        while not self.stopping.wait(self.poll_s):
            ready, shutting_down = self.state()
            if shutting_down:
                return
            armed = armed or ready
            if not armed:
                continue
            self._track(rescan=polls % RESCAN_EVERY == 0)
            polls += 1
            dead = self._first_dead()
            if dead is None:
                continue
            pid, title, code = dead
            if code == 0 or self.stopping.is_set() or self.state()[1]:
                return  # a clean exit: SGLang is shutting down
            self._fire(pid, title, code)
            return

    def _track(self, rescan: bool = True) -> None:
        """Remember every server process (with its multiprocessing handle when it is our child,
        for its exit status). Our children are checked on each poll (a cheap in-process list);
        the whole tree, grandchildren and the files it holds, on a rescan."""
        handles = {p.pid: p for p in multiprocessing.active_children()}
        try:
            procs = [self.me, *self.me.children(recursive=True)] if rescan else [
                psutil.Process(pid) for pid in handles if pid not in self.tracked]
        except psutil.Error:
            return
        for p in procs:
            title = _title(p) if p.pid not in self.tracked and p.pid != self.me.pid else ""
            if title.startswith("sglang::"):
                self.tracked[p.pid] = (title, handles.get(p.pid))
        if rescan:
            self.files |= owned_files(procs)

    def _first_dead(self) -> tuple[int, str, int | None] | None:
        for pid, (title, handle) in self.tracked.items():
            if handle is not None:
                if not handle.is_alive():
                    return pid, title, handle.exitcode
                continue
            try:  # a grandchild (e.g. a scheduler under the DP controller): no exit status here
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return pid, title, None
            except psutil.NoSuchProcess:
                return pid, title, None
        return None

    def _fire(self, pid: int, title: str, code: int | None) -> None:
        self.fired = (f"superinfer_sgl: error: the {describe_role(title)} process (pid {pid}) died, "
                      f"{describe_exit(code)}; stopping the server")
        print(self.fired, file=sys.stderr, flush=True)
        try:
            self.files |= owned_files([self.me, *self.me.children(recursive=True)])
        except psutil.Error:
            pass
        t0 = time.monotonic()
        left = kill_tree(self.me)
        removed = unlink_all(self.files) + _remove_metrics_dir()
        print(f"superinfer_sgl: stopped every server process{f' but {left}' if left else ''} in "
              f"{time.monotonic() - t0:.1f} s; removed {len(removed)} shared-memory segment(s), socket "
              f"file(s) and folder(s)", file=sys.stderr, flush=True)
        self.exit(EXIT_CHILD_DIED)

    def cleanup(self) -> list[str]:
        """After the launcher's own teardown (children gone): unlink what the tree held."""
        self.stopping.set()
        return unlink_all(self.files)
