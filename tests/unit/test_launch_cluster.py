"""launch_cluster without servers: option checks, and stop() ending whole process groups."""

from __future__ import annotations

import argparse
import time

import psutil
import pytest

from superinfer_sgl import launch_cluster as lc


def test_replica_args_pass_through_and_gateway_flags_are_ours() -> None:
    ns, rest = lc.parse(["--replicas", "3", "--port", "9000", "--max-total-tokens", "4096", "--dtype", "float32"])
    assert (ns.replicas, ns.port, rest) == (3, 9000, ["--max-total-tokens", "4096", "--dtype", "float32"])
    assert lc.Cluster(ns, rest).ports == [9001, 9002, 9003]
    ns, _ = lc.parse(["--replicas", "2", "--replica-ports", "7001,7005"])
    assert lc.Cluster(ns, []).ports == [7001, 7005]


@pytest.mark.parametrize("argv", [["--replicas", "0"], ["--replicas", "2", "--replica-ports", "1"],
                                  ["--replica-ports", "a,b"], ["--", "--host", "0.0.0.0"]])
def test_bad_options_exit_with_a_message(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        lc.parse(argv)


def test_stop_ends_each_process_group_children_included() -> None:
    ns = argparse.Namespace(log_dir=None)
    cluster = lc.Cluster.__new__(lc.Cluster)
    cluster.ns, cluster._logs, cluster.gateway = ns, [], None
    # A "replica" that starts a child and ignores SIGTERM: only SIGKILL of its group ends both.
    cluster.replicas = [cluster._spawn(["sh", "-c", "trap '' TERM; sleep 300 & wait"], "fake")]
    time.sleep(0.5)
    tree = [cluster.replicas[0].pid] + [c.pid for c in psutil.Process(cluster.replicas[0].pid).children()]
    assert len(tree) == 2
    lc.STOP_GRACE_S, saved = 1.0, lc.STOP_GRACE_S
    try:
        cluster.stop()
    finally:
        lc.STOP_GRACE_S = saved
    time.sleep(0.5)
    alive = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive


def test_a_busy_gateway_metrics_port_is_refused_before_any_replica_starts() -> None:
    import socket

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        busy = held.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ns, rest = lc.parse(["--replicas", "1", "--port", str(port), "--replica-ports", str(_free()),
                             "--gateway-prometheus-port", str(busy)])
        cluster = lc.Cluster(ns, rest)
        with pytest.raises(lc.LaunchError, match=f"port {busy} .*metrics port"):
            cluster.start()
        assert cluster.replicas == []


def _free() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
