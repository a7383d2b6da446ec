"""Defects a review of the launchers and the deployment path found (2026-12-03), each reproduced
without a model: the cluster's ports, its --policy, GPU placement, a dead cluster that kept running,
a proxy in the environment, IPv6 hosts, SGLang's --config file, repeated flags and the long
spellings of the parallel sizes."""

from __future__ import annotations

import argparse
import http.server
import subprocess
import threading

import pytest

from superinfer_sgl import launch_cluster as lc
from superinfer_sgl import launch_server
from superinfer_sgl.device_defaults import cpu_ranks
from superinfer_sgl.launch_checks import LaunchError, flag_value, parallel_flag


@pytest.mark.parametrize("argv", [
    ["--replica-ports", "31000,31001"],  # the gateway's metrics port (30000 + 1000): the docs' old example
    ["--port", "38000", "--replica-ports", "38000,38001"],  # the gateway's own port
    ["--replica-ports", "31001,31001"],
    ["--port", "0"],
    ["--port", "65000"],  # its metrics port would be 66000
    ["--replica-base-port", "0"],  # was read as "not given" (port + 1)
    ["--gateway-prometheus-port", "30001"],
])
def test_ports_that_clash_or_cannot_exist_are_refused_up_front(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        lc.parse(argv)


def test_policy_is_the_replicas_and_the_gateway_has_its_own() -> None:
    ns, rest = lc.parse(["--policy", "paper", "--gateway-policy", "round_robin"])
    assert rest == ["--policy", "paper"] and ns.gateway_policy == "round_robin"
    assert lc.parse([])[0].gateway_policy == "cache_aware"


def test_replicas_get_their_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(lc, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert lc.replica_gpus(4, []) == [0, 1, 2, 3]
    assert lc.replica_gpus(3, ["--tp-size", "2"]) == [0, 2, 4]
    assert lc.replica_gpus(2, ["--tensor-parallel-size", "2", "--dp-size", "2"]) == [0, 4]
    assert lc.replica_gpus(2, ["--base-gpu-id", "4"]) is None  # placed by the user
    assert lc.replica_gpus(2, ["--device", "cpu"]) is None
    with pytest.raises(LaunchError, match="need 16 GPUs"):
        lc.replica_gpus(2, ["--tp-size", "8"])
    monkeypatch.setattr(lc, "has_cuda", lambda: False)
    assert lc.replica_gpus(2, []) is None


def test_the_cluster_exits_when_no_replica_is_left() -> None:
    cluster = lc.Cluster.__new__(lc.Cluster)
    cluster.ns, cluster._logs, cluster.reported_dead = argparse.Namespace(log_dir=None), [], set()
    cluster.ports = [1, 2]
    cluster.replicas = [subprocess.Popen(["true"]), subprocess.Popen(["true"])]
    cluster.gateway = subprocess.Popen(["sleep", "60"])
    try:
        for p in cluster.replicas:
            p.wait(10)
        assert cluster.watch() == 1  # (it waited on the gateway for ever)
    finally:
        cluster.gateway.kill()
        cluster.gateway.wait()


def test_local_checks_ignore_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
        monkeypatch.setenv("NO_PROXY", "")
        assert lc._ok(f"http://127.0.0.1:{server.server_address[1]}/")
    finally:
        server.shutdown()


def test_ipv6_hosts_are_bracketed_in_urls() -> None:
    assert lc._url_host("::1") == "[::1]" and lc._url_host("127.0.0.1") == "127.0.0.1"
    assert lc._url_host("[::1]") == "[::1]"


def test_repeated_flags_and_long_parallel_spellings() -> None:
    assert flag_value(["--port", "30001", "--port=30002"], "--port") == "30002"  # argparse: the last
    assert parallel_flag(["--data-parallel-size", "2"], "dp") == ("--data-parallel-size", "2")
    assert cpu_ranks(["--data-parallel-size", "2", "--tensor-parallel-size", "2"]) == 4
    assert cpu_ranks(["--pipeline-parallel-size", "3"]) == 3
    assert launch_server.model_parallel_flags(["--tensor-parallel-size", "2"]) == {"--tensor-parallel-size": 2}


def test_a_config_file_is_read_before_our_checks(tmp_path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text("model-path: /nonexistent/model\nport: 31555\nscheduler: sglang\nenable-metrics: true\n")
    argv = launch_server.expand_config(["--config", str(cfg), "--port", "31556"])
    assert flag_value(argv, "--port") == "31556"  # the command line wins, as in SGLang's merge
    assert flag_value(argv, "--model-path") == "/nonexistent/model" and "--enable-metrics" in argv
    ns, _ = launch_server.our_parser().parse_known_args(argv)
    assert ns.scheduler == "sglang"  # our options in the file are ours (it reached SGLang as an abbreviation)
    with pytest.raises(LaunchError, match="does not exist"):  # the file's model, not the default one
        launch_server.prepare(["--config", str(cfg)])
    assert launch_server.expand_config([f"--config={cfg}"])[:2] == ["--model-path", "/nonexistent/model"]
    with pytest.raises(LaunchError, match="--config"):
        launch_server.expand_config(["--config", str(tmp_path / "missing.yaml")])
    ns, rest = lc.parse(["--config", str(cfg)])  # in a cluster the file's port is the gateway's
    assert ns.port == 31555 and "--config" not in rest and flag_value(rest, "--model-path") == "/nonexistent/model"


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_closed_terminal_stops_the_cluster_as_sigterm_does(monkeypatch: pytest.MonkeyPatch, sig: str) -> None:
    """SIGHUP (the launcher's terminal closed) ended it without its cleanup: replicas were left to
    PR_SET_PDEATHSIG's SIGTERM with no SIGKILL after it."""
    import os
    import signal
    import time

    stopped = []
    monkeypatch.setattr(lc.Cluster, "start", lambda self: time.sleep(30))
    monkeypatch.setattr(lc.Cluster, "stop", lambda self: stopped.append(True))
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    timer = threading.Timer(0.5, os.kill, (os.getpid(), getattr(signal, sig)))
    timer.start()
    try:
        assert lc.main([]) == 0 and stopped == [True]
    finally:
        timer.cancel()
        for s, handler in saved.items():
            signal.signal(s, handler)
