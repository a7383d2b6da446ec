"""`python -m superinfer_sgl.launch_cluster --replicas N`: N superinfer servers behind SGLang's model
gateway (SMG, the `smg` package), on one machine.

Each replica is `python -m superinfer_sgl.launch_server` on its own port, in its own process group
(so one can be stopped, or killed, with everything it started); the gateway listens on `--port` and
routes across them. Arguments this launcher does not know pass to every replica unchanged (model,
SGLang and RotaSched options, `--policy` included; a `--config` file is read here and written out as
flags). On a GPU machine replica i gets the GPUs from `--base-gpu-id` i x (dp x tp x pp) on. Ctrl-C,
SIGTERM or SIGHUP (its terminal closed) stops the gateway and every replica; a replica that dies on
its own is reported and the gateway keeps serving from the others (its health checks take the dead
one out of rotation); when none is left the cluster exits with 1. On separate machines, run
launch_server on each and `smg launch --worker-urls ...` in front (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import requests

from .device_defaults import THREADS_BIND_ENV, cpu_ranks, has_cuda, parse_cpulist, replica_threads_binds
from .launch_checks import LaunchError, check_port_free, flag_given, flag_value, parallel_flag

logger = logging.getLogger("superinfer_sgl.cluster")
READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1
_LOCAL = requests.Session()
_LOCAL.trust_env = False  # our own replicas and gateway: never through $HTTP_PROXY


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m superinfer_sgl.launch_cluster", allow_abbrev=False,
        description="N superinfer_sgl replicas behind SGLang's model gateway (smg). Unknown arguments "
                    "go to every replica (python -m superinfer_sgl.launch_server).")
    p.add_argument("--replicas", type=int, default=2, help="number of servers (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="gateway port (default 30000)")
    p.add_argument("--replica-base-port", type=int, default=None,
                   help="replica i listens on this + i (default: gateway port + 1)")
    p.add_argument("--replica-ports", default=None,
                   help="comma-separated replica ports, one per replica (overrides --replica-base-port)")
    p.add_argument("--gateway-policy", default="cache_aware",
                   help="gateway routing policy (smg --policy: cache_aware, round_robin, power_of_two, "
                        "least_load, ...; default cache_aware, smg's own); --policy is the replicas' "
                        "RotaSched policy")
    p.add_argument("--gateway-prometheus-port", type=int, default=None,
                   help="the gateway's own /metrics port (default: gateway port + 1000)")
    p.add_argument("--health-check-interval-secs", type=int, default=5,
                   help="how often the gateway probes each replica's /health (default 5)")
    p.add_argument("--gateway-args", default="",
                   help="more smg options, one shell-quoted string, e.g. \"--max-concurrent-requests 64\"")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="write replica-<i>.log and gateway.log here (default: all to this terminal)")
    from .launch_server import expand_config  # (a --config file's --port / --host are the gateway's too)

    try:
        ns, rest = p.parse_known_args(expand_config(argv))
    except LaunchError as exc:
        p.error(str(exc))
    if ns.replicas < 1:
        p.error("--replicas must be >= 1")
    if ns.replica_ports is not None:
        try:
            ns.replica_ports = [int(x) for x in ns.replica_ports.split(",")]
        except ValueError:
            p.error(f"--replica-ports must be comma-separated integers, got {ns.replica_ports!r}")
        if len(ns.replica_ports) != ns.replicas:
            p.error(f"--replica-ports names {len(ns.replica_ports)} ports for {ns.replicas} replicas")
    for flag in ("--port", "--host"):
        if flag_given(rest, flag):
            p.error(f"{flag} is the gateway's; replicas take --replica-base-port")
    dp = parallel_flag(rest, "dp")
    if dp is not None and dp[1] != "1":
        logger.warning("each replica runs its own %s %s", *dp)
    try:
        ns.ports = replica_ports(ns)
    except LaunchError as exc:
        p.error(str(exc))
    return ns, rest


def replica_ports(ns: argparse.Namespace) -> list[int]:
    """The replicas' ports; every port of the cluster (the gateway's, its metrics port, the
    replicas') distinct and valid, or LaunchError (one clash would otherwise fail the gateway
    minutes later, after every replica has loaded)."""
    base = ns.replica_base_port if ns.replica_base_port is not None else ns.port + 1
    ports = ns.replica_ports or [base + i for i in range(ns.replicas)]
    named = {"--port": [ns.port], "the gateway's metrics port": [prometheus_port(ns)], "a replica": ports}
    every = [port for group in named.values() for port in group]
    bad = [port for port in every if not 1 <= port <= 65535]
    if bad:
        raise LaunchError(f"ports must be 1..65535, got {bad[0]} ({', '.join(f'{k} {v}' for k, v in named.items())})")
    if len(set(every)) != len(every):
        raise LaunchError("two parts of the cluster would share a port: "
                          + ", ".join(f"{k} {v}" for k, v in named.items()))
    return ports


def prometheus_port(ns: argparse.Namespace) -> int:
    """The gateway's own /metrics port (smg binds it on every address)."""
    return ns.gateway_prometheus_port if ns.gateway_prometheus_port is not None else ns.port + 1000


def _url_host(host: str) -> str:
    """A host as it goes in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def replica_gpus(replicas: int, args: list[str]) -> list[int] | None:
    """On a GPU machine, each replica's first GPU (`--base-gpu-id`): replica i starts at i x its
    ranks (dp x tp x pp), so replicas do not share GPUs; None on a CPU machine, or where the replicas'
    arguments already name one (the user placed them). LaunchError when the GPUs are too few."""
    if flag_given(args, "--base-gpu-id") or flag_value(args, "--device") not in (None, "cuda") or not has_cuda():
        return None
    import torch

    per = cpu_ranks(args)  # (the same product: one GPU per rank)
    if replicas * per > torch.cuda.device_count():
        raise LaunchError(f"{replicas} replicas x {per} GPU(s) each need {replicas * per} GPUs, "
                          f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES)")
    return [i * per for i in range(replicas)]


def _die_with_parent() -> None:
    """Child side, before exec: get SIGTERM if this launcher dies without cleaning up (even SIGKILL),
    so no replica outlives it. Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Cluster:
    def __init__(self, ns: argparse.Namespace, replica_args: list[str]) -> None:
        self.ns, self.replica_args = ns, replica_args
        self.ports = getattr(ns, "ports", None) or replica_ports(ns)
        self.prom_port = prometheus_port(ns)
        self.replicas: list[subprocess.Popen] = []
        self.gateway: subprocess.Popen | None = None
        self.reported_dead: set[int] = set()
        self._logs: list[IO[bytes]] = []

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _out(self, name: str) -> IO[bytes] | None:
        if self.ns.log_dir is None:
            return None
        self.ns.log_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.ns.log_dir / f"{name}.log", "ab")
        self._logs.append(f)
        return f

    def _spawn(self, cmd: list[str], name: str, env: dict[str, str] | None = None,
               cores: set[int] | None = None) -> subprocess.Popen:
        out = self._out(name)
        logger.info("starting %s: %s", name, shlex.join(cmd))

        def pre() -> None:
            _die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        # start_new_session: its own process group, so stop() (or a test) can signal all of it.
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                start_new_session=True, preexec_fn=pre)

    def start(self) -> None:
        for port in [self.ns.port, *self.ports]:
            check_port_free(self.ns.host if port == self.ns.port else "127.0.0.1", port)
        try:  # else the gateway dies after the replicas have started
            check_port_free("::" if ":" in self.ns.host else "0.0.0.0", self.prom_port)
        except LaunchError as exc:
            raise LaunchError(f"{exc} (the gateway's metrics port: --gateway-prometheus-port)") from None
        args = self.replica_args
        if not (flag_given(args, "--model-path") or flag_given(args, "--model")):
            # Prepare the default model once, here: N replicas converting it at once would race.
            from .model_prep import ModelPrepError, prepare_default_model

            try:
                args = ["--model-path", str(prepare_default_model()), *args]
            except ModelPrepError as exc:
                raise LaunchError(str(exc)) from exc
        binds = replica_threads_binds(len(self.ports), args)
        gpus = replica_gpus(len(self.ports), args)
        for i, port in enumerate(self.ports):
            cmd = [sys.executable, "-m", "superinfer_sgl.launch_server", "--host", "127.0.0.1",
                   "--port", str(port), *args]
            if gpus is not None:
                cmd += ["--base-gpu-id", str(gpus[i])]
                logger.info("replica-%d: GPUs from %d", i, gpus[i])
            env, cores = None, None
            if binds is not None:
                # SGLang applies its binding only with its AMX/arm64 CPU kernels; the affinity and
                # the thread count hold everywhere (threads spinning on a shared core thrash).
                cores = parse_cpulist(binds[i])
                env = {**os.environ, THREADS_BIND_ENV: binds[i], "OMP_NUM_THREADS": str(len(cores))}
                logger.info("replica-%d: cores %s", i, binds[i])
            self.replicas.append(self._spawn(cmd, f"replica-{i}", env, cores))
        self._wait_replicas()
        prom = self.prom_port
        cmd = [sys.executable, "-m", "smg.launch_router", "--host", self.ns.host, "--port", str(self.ns.port),
               "--worker-urls", *self.worker_urls, "--policy", self.ns.gateway_policy,
               "--prometheus-port", str(prom),
               "--health-check-interval-secs", str(self.ns.health_check_interval_secs),
               *shlex.split(self.ns.gateway_args)]
        self.gateway = self._spawn(cmd, "gateway")
        self._wait_gateway()
        print(f"superinfer_sgl cluster ready: gateway http://{_url_host(self.ns.host)}:{self.ns.port} -> "
              + ", ".join(f"replica {i} {u} (pid {p.pid})" for i, (u, p) in
                          enumerate(zip(self.worker_urls, self.replicas))), flush=True)

    def _wait_replicas(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = dict(enumerate(self.worker_urls))
        while pending:
            for i, url in list(pending.items()):
                code = self.replicas[i].poll()
                if code is not None:
                    raise LaunchError(f"replica {i} exited with {code} while starting"
                                      + (f" (see {self.ns.log_dir}/replica-{i}.log)" if self.ns.log_dir else ""))
                if _ok(url + "/health"):
                    logger.info("replica %d ready at %s", i, url)
                    del pending[i]
            if pending and time.monotonic() > deadline:
                raise LaunchError(f"replicas {sorted(pending)} not healthy after {READY_TIMEOUT_S:.0f}s")
            time.sleep(1)

    def _wait_gateway(self) -> None:
        """Until the gateway lists every replica as a healthy, ready worker (it registers them in
        the background after its own /health answers: requests before that get a 404)."""
        assert self.gateway is not None
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.ns.host, self.ns.host)
        url = f"http://{_url_host(host)}:{self.ns.port}"
        deadline = time.monotonic() + 120
        while True:
            ready = _ready_workers(url)
            if ready >= set(self.worker_urls):
                return
            if self.gateway.poll() is not None:
                raise LaunchError(f"the gateway (smg) exited with {self.gateway.returncode} while starting")
            if time.monotonic() > deadline:
                raise LaunchError(f"the gateway (smg) registered {sorted(ready)} of {self.worker_urls} in 120s")
            time.sleep(0.5)

    def watch(self) -> int:
        """Until a signal: report replicas that die; stop when the gateway or the last replica dies
        (nothing serves: a supervisor must hear of it)."""
        assert self.gateway is not None
        while True:
            for i, proc in enumerate(self.replicas):
                if proc.poll() is not None and i not in self.reported_dead:
                    self.reported_dead.add(i)
                    alive = sum(p.poll() is None for p in self.replicas)
                    logger.error("replica %d (%s) exited with %s; the gateway keeps routing to the %d left",
                                 i, self.worker_urls[i], proc.returncode, alive)
                    if alive == 0:
                        logger.error("no replica is left; stopping the gateway")
                        return 1
            if self.gateway.poll() is not None:
                logger.error("the gateway exited with %s; stopping the replicas", self.gateway.returncode)
                return 1
            time.sleep(1)

    def stop(self) -> None:
        """SIGTERM every process group (the gateway first: no new requests), then SIGKILL what is left."""
        procs = [p for p in [self.gateway, *self.replicas] if p is not None]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Children of a replica (SGLang's scheduler, detokenizer) share its group: kill the group
        # even when the leader is gone, then reap.
        time.sleep(0.5)
        for p in procs:
            _signal_group(p, signal.SIGKILL)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                logger.error("pid %d did not exit after SIGKILL", p.pid)
        for f in self._logs:
            f.close()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # pgid == pid: start_new_session
    except (ProcessLookupError, PermissionError):
        pass


def _ready_workers(gateway_url: str) -> set[str]:
    """URLs of the workers the gateway reports healthy and ready (smg's GET /workers)."""
    try:
        workers = _LOCAL.get(gateway_url + "/workers", timeout=10).json().get("workers", [])
    except (requests.RequestException, ValueError):
        return set()
    return {w.get("url") for w in workers if w.get("is_healthy") and w.get("status") == "ready"}


def _ok(url: str) -> bool:
    try:
        return _LOCAL.get(url, timeout=30).status_code == 200
    except requests.RequestException:
        return False


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[cluster] %(message)s")
    ns, rest = parse(list(sys.argv[1:] if argv is None else argv))
    cluster = Cluster(ns, rest)

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # unwinds start() or watch() into the finally below

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # its terminal closed: stop everything as for Ctrl-C
    try:
        cluster.start()
        return cluster.watch()
    except LaunchError as exc:
        print(f"superinfer_sgl cluster: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        logger.info("stopping")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
