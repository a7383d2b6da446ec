"""scripts/soak_leak.py's verdict (issue 38 item 2): a process whose private memory (USS) grows
faster than the stated bound after the warm-up fails the leak soak; growth during the warm-up,
shared-page (RSS-only) swings and a restarted process's new pid do not."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _leak():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("soak_leak", ROOT / "scripts" / "soak_leak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_leak"] = module
    spec.loader.exec_module(module)
    return module


MB = 1e6 / 2**20  # MiB per MB: samples are in MiB, slopes in MB/h


def _samples(uss_mb_per_h: dict[str, float], minutes: int = 60, warmup_jump_mb: float = 0.0,
             rss_swing_mb: float = 0.0, noise_mb: float = 0.5, seed: int = 0) -> list[dict]:
    """One sample a minute: each process's USS rises at its rate (plus noise, plus a step during
    the first 10 minutes); RSS additionally loses `rss_swing_mb` of shared pages half way."""
    rng = random.Random(seed)
    rows = []
    for m in range(minutes + 1):
        t_s, procs = m * 60.0, {}
        for k, (name, rate) in enumerate(uss_mb_per_h.items()):
            uss = 1000 + rate * m / 60 + (warmup_jump_mb if m >= 5 else 0.0) + rng.gauss(0, noise_mb)
            rss = uss + 400 - (rss_swing_mb if m >= minutes // 2 else 0.0)
            procs[name] = {"pid": 100 + k, "rss_mib": rss * MB, "uss_mib": uss * MB, "anon_mib": uss * MB,
                           "locked_mib": 0.0}
        rows.append({"t_s": t_s, "procs": procs, "host": {"superinfer_host_pool_blocks_used": 0.0}})
    return rows


def test_a_process_growing_past_the_bound_fails_and_is_named() -> None:
    report = _leak().verdict(_samples({"scheduler": 35.0, "launcher": 1.0}), warmup_s=600, bound_mb_h=20)
    assert report["over_bound"] == ["scheduler"]
    assert abs(report["uss_slopes"]["scheduler"]["slope_mb_per_h"] - 35.0) < 3
    lo, hi = report["uss_slopes"]["scheduler"]["ci95_mb_per_h"]
    assert lo < 35.0 < hi


def test_flat_memory_passes_and_the_warmup_is_left_out() -> None:
    # a 300 MB step at minute 5 (queues filling): inside the 10-minute warm-up, so no slope
    report = _leak().verdict(_samples({"scheduler": 0.0, "detokenizer": 2.0}, warmup_jump_mb=300),
                             warmup_s=600, bound_mb_h=20)
    assert report["over_bound"] == []
    assert set(report["fitted"]) == {"scheduler", "detokenizer"}
    # the same step counted (no warm-up) would be read as a leak
    assert _leak().verdict(_samples({"scheduler": 0.0}, warmup_jump_mb=300), warmup_s=0,
                           bound_mb_h=20)["over_bound"] == ["scheduler"]


def test_the_verdict_is_on_uss_not_on_shared_pages() -> None:
    # the kernel drops 350 MB of shared file pages half way: RSS slope hugely negative, USS flat
    report = _leak().verdict(_samples({"scheduler": 0.0}, rss_swing_mb=-350), warmup_s=600, bound_mb_h=20)
    assert report["slopes"]["scheduler"]["slope_mb_per_h"] > 100  # RSS "grew" (pages faulted back in)
    assert report["over_bound"] == []


def test_a_restarted_process_is_not_fitted_across_pids() -> None:
    rows = _samples({"scheduler": 0.0})
    for row in rows[30:]:  # a restart: new pid, and 500 MB more from a cold start
        p = row["procs"]["scheduler"]
        p["pid"], p["uss_mib"] = 999, p["uss_mib"] + 500 * MB
    report = _leak().verdict(rows, warmup_s=600, bound_mb_h=20)
    assert "note" in report["uss_slopes"]["scheduler"] and report["over_bound"] == []


def test_the_reanalysis_command_exits_1_over_the_bound(tmp_path: Path) -> None:
    leak = _leak()
    for rate, code in ((50.0, 1), (5.0, 0)):
        path = tmp_path / f"samples_{rate}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _samples({"scheduler": rate})))
        out = tmp_path / f"out_{rate}"
        assert leak.main(["--samples", str(path), "--out", str(out), "--warmup-s", "600"]) == code
        assert (out / "leak.json").exists()
