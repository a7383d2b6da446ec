"""`prefix_ab --paired` (bench/prefix_ab.py): ours beside each stock arm, both servers at once on
their own cores, the same workload driven at both; no model or server (launch and the load
generator replaced)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from superinfer_sgl.bench import prefix_ab


def test_pair_schedule_puts_ours_beside_every_stock_arm_and_swaps_cores() -> None:
    sched = prefix_ab.pair_schedule(["predictive+host", "lru", "tlru", "slru"], repeats=2)
    assert [(r, o, s) for r, o, s, _ in sched[:3]] == [(0, "predictive+host", b) for b in ("lru", "tlru", "slru")]
    assert [s for r, _, s, _ in sched if r == 1] == ["tlru", "slru", "lru"]  # order rotated
    assert [sw for *_, sw in sched] == [False, True] * 3  # sides alternate cores run to run
    with pytest.raises(ValueError, match="stock arm"):
        prefix_ab.pair_schedule(["predictive+host"], 1)
    with pytest.raises(ValueError, match="our arms"):
        prefix_ab.pair_schedule(["lru", "tlru"], 1)


def test_paired_run_drives_both_servers_at_once_on_their_halves(tmp_path: Path, monkeypatch) -> None:
    launched: list[tuple[str, frozenset[int]]] = []
    stopped: list[str] = []

    class Server:
        def __init__(self, name: str) -> None:
            self.url = f"http://{name}"
            self.name = name

        def stop(self) -> list[int]:
            stopped.append(self.name)
            return []

    def launch(spec, shared, log, ready_timeout_s, cores=None):  # noqa: ANN001, ANN202
        launched.append((spec.name, cores))
        return Server(spec.name)

    driven: list[list[str]] = []

    def on_each(urls, kind, work, cores):  # noqa: ANN001, ANN202
        driven.append(list(urls))
        assert cores in ([frozenset({0}), frozenset({1})], [frozenset({1}), frozenset({0})])
        return [{"records": [], "wall_s": 1.0, "peak_token_usage": 0.1} for _ in urls]

    monkeypatch.setattr(prefix_ab, "launch", launch)
    monkeypatch.setattr(prefix_ab, "core_halves", lambda: (frozenset({0}), frozenset({1})))
    monkeypatch.setattr(prefix_ab, "run_workload_on_each", on_each)
    monkeypatch.setattr(prefix_ab, "_flush", lambda url: None)
    monkeypatch.setattr(prefix_ab, "build", lambda kind, seed, rate, duration: [])
    args = SimpleNamespace(tlru_threshold=64, tlru_next=11, host_tokens=800, arms="predictive+host,lru,tlru",
                           workloads="tenants,unique", rate_tenants=1.0, rate_conversations=0.3, rate_unique=0.5,
                           model="m", kv_tokens=800, chunked_prefill=512, out=str(tmp_path / "ab.json"),
                           repeats=1, seed=0, duration=1.0, paired=True, ttft_slo_ms=None, tbt_slo_ms=None)
    runs = prefix_ab.run(args)["runs"]
    assert launched == [("ours-predictive-host", frozenset({0})), ("sglang-lru", frozenset({1})),
                        ("ours-predictive-host", frozenset({1})), ("sglang-tlru", frozenset({0}))]
    assert driven == [["http://ours-predictive-host", "http://sglang-lru"]] * 2 + \
        [["http://ours-predictive-host", "http://sglang-tlru"]] * 2
    assert len(stopped) == 4  # every server stopped after its pair
    assert [(r["arm"], r["beside"], r["kind"], r["cores"]) for r in runs[:4]] == [
        ("predictive+host", "lru", "tenants", [0]), ("lru", "predictive+host", "tenants", [1]),
        ("predictive+host", "lru", "unique", [0]), ("lru", "predictive+host", "unique", [1])]


def test_each_side_s_load_generator_runs_on_its_own_cores(monkeypatch) -> None:
    """run_workload_on_each pins each side's driver thread to that side's cores."""
    import os

    from superinfer_sgl.bench import prefix_client

    seen: dict[str, set[int]] = {}

    async def fake_run(url, kind, work, slo_class):  # noqa: ANN001, ANN202
        seen[url] = os.sched_getaffinity(0)
        return [], 1.0, 0.5

    monkeypatch.setattr(prefix_client, "_run", fake_run)
    mine = sorted(os.sched_getaffinity(0))
    halves = [frozenset(mine[:1]), frozenset(mine[-1:])]
    out = prefix_client.run_workload_on_each(["a", "b"], "tenants", [], halves)
    assert seen == {"a": set(halves[0]), "b": set(halves[1])}
    assert out == [{"records": [], "wall_s": 1.0, "peak_token_usage": 0.5}] * 2
    assert os.sched_getaffinity(0) == set(mine)  # the caller's own affinity is left alone


def test_goodput_arms_are_told_the_run_s_slos_and_need_them(tmp_path: Path) -> None:
    """The arms with our default scheduler carry the SLOs the run measures; without fixed SLOs
    they are not offered, and asking for one says why."""
    table = prefix_ab.arms(64, 11, 800, (289.0, 47.5))
    for name in ("goodput-radix", "goodput+predictive+host"):
        flags = table[name].flags
        assert "--scheduler" not in flags  # our default scheduler (RotaSched)
        assert flags[flags.index("--ttft-slo-ms") + 1] == "289" and flags[flags.index("--tbt-slo-ms") + 1] == "47.5"
    assert table["goodput+predictive+host"].flags[:4] == ("--prefix-cache", "predictive", "--prefix-host-tokens", "800")
    assert table["goodput-radix"].flags[:2] == ("--prefix-cache", "radix")
    assert "goodput-radix" not in prefix_ab.arms(64, 11)
    args = SimpleNamespace(tlru_threshold=64, tlru_next=11, host_tokens=800, arms="goodput-radix,lru",
                           workloads="tenants", rate_tenants=1.0, rate_conversations=0.3, rate_unique=0.5,
                           model="m", kv_tokens=800, chunked_prefill=512, out=str(tmp_path / "ab.json"),
                           repeats=1, seed=0, duration=1.0, paired=True, ttft_slo_ms=None, tbt_slo_ms=None)
    with pytest.raises(SystemExit, match="need --ttft-slo-ms and --tbt-slo-ms"):
        prefix_ab.run(args)
