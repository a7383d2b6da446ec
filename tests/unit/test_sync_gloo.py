"""The TP decision broadcast across two real processes over a gloo CPU process group.

`--tp-size 2` does not start on this CPU (SGLang builds a NCCL communicator for its model-parallel
group, docs/deploy.md), so this runs the server's own broadcaster (`integration.startup.broadcaster`,
SGLang's `broadcast_pyobj`) over the kind of group SGLang gives a scheduler as `tp_cpu_group`
(`torch.distributed.new_group(backend="gloo")`), in two spawned processes, with `DecisionSync` on
top: rank 0 decides, rank 1 adopts, even where rank 1's clock would have decided otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.utils")

WORLD = 2


def _decide_at(now: float, n: int):
    from superinfer_sgl.rotasched import ReqState, ReqView, VltParams, lvf_decide

    # n waiting requests and one running one; at t=4 the waiting ones displace it, at t=2 not.
    views = [ReqView(f"w{i}", ReqState.WAITING, 0.0, None, None, 5.0, 0.1, 4, 0) for i in range(n)]
    views.append(ReqView("r", ReqState.RUNNING, 0.0, 0.5, 0.5, 5.0, 0.1, 0, 4 * n))
    return lvf_decide(views, 0, 4 * n, now, VltParams())


def _rank_main(rank: int, port: int, out: mp.Queue) -> None:
    import torch.distributed as dist

    from superinfer_sgl.integration.startup import broadcaster
    from superinfer_sgl.rotasched import DecisionSync

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD)
        group = dist.new_group(backend="gloo")
        sched = SimpleNamespace(tp_rank=rank, tp_size=WORLD, tp_cpu_group=group)
        broadcast = broadcaster(sched)
        sync = DecisionSync(rank, broadcast)
        calls = 0
        got = []
        for it, n in enumerate((1, 3, 200)):  # 200 rids: a payload well over one small message

            def decide(n: int = n):
                nonlocal calls
                calls += 1
                return _decide_at(4.0 if rank == 0 else 2.0, n)

            got.append(sync.decide(decide, 100 + it if rank == 0 else 7))  # rank 1 measured another budget
        dist.destroy_process_group()
        out.put((rank, got, calls, None))
    except Exception as exc:  # reported to the test, which fails with it
        out.put((rank, None, None, repr(exc)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_decision_broadcast_over_gloo_processes() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(WORLD):
            rank, got, calls, err = out.get(timeout=240)
            assert err is None, f"rank {rank}: {err}"
            results[rank] = (got, calls)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = [(_decide_at(4.0, n), 100 + it) for it, n in enumerate((1, 3, 200))]
    assert not _decide_at(2.0, 1).admit and expected[0][0].admit  # the clocks would disagree
    assert results[0] == (expected, 3)
    assert results[1] == (expected, 0)  # rank 1 adopted rank 0's decisions and budgets, never ran LVF
    assert all(p.exitcode == 0 for p in procs)
