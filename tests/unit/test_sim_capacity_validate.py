"""The planner against a live capacity run (sim/capacity_validate.py), on a synthetic run folder in
ab_bench.py --capacity's format: its 'measurements' are the simulator's own at a known machine speed
(3x slower than the profile), its step logs ran at that speed, so the replay of the search must find
the measured capacities and the planner must see the speed. No server."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from superinfer_sgl.bench import capacity_live, capacity_stats
from superinfer_sgl.bench.workloads import search_arrivals
from superinfer_sgl.sim import capacity_validate as cv
from superinfer_sgl.sim import steplog, validate
from superinfer_sgl.sim.__main__ import main
from superinfer_sgl.sim.capacity import CapacityGrid, find_capacity
from superinfer_sgl.sim.plan import MixClass, Population, mix_workload
from superinfer_sgl.sim.profile import resolve_profile
from superinfer_sgl.sim.runner import simulate
from superinfer_sgl.sim.workload import recorded_workload, served_rows

SLOWER = 3.0
N = 16
PROFILE = "cpu-smollm2-135m"
COMMANDS = {"sglang": ["-m", "sglang.launch_server", "--max-total-tokens", "1536"],
            "superinfer": ["-m", "superinfer_sgl.launch_server", "--max-total-tokens", "1536", "--scheduler",
                           "rotasched", "--policy", "goodput"]}
GRID = CapacityGrid(target=0.9, lo=0.3, hi=4.8, growth=1.4, resolution=0.1, stop_after=2)
PLANNER = dict(duration=60.0, seeds=1, resolution=0.1)


def _requests() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_tokens": rng.randint(60, 220), "output_tokens": rng.randint(8, 40), "slo_class": None,
             "ttft_slo_ms": 4000.0, "tbt_slo_ms": 600.0, "priority": 0} for _ in range(N)]


def _probe(base, slower: float) -> dict:
    """A speed probe that saw the machine `slower` times slower than the profile (as in test_sim_scenario)."""
    n, out = 150, 16
    ctx = n + out // 2
    return {"steps_ms": [[b, 1000.0 * slower * base.step.seconds(decode_reqs=b, decode_context=b * ctx)] for b in (1, 4)],
            "prefill_ms_per_token": 1000.0 * slower * base.step.prefill_alone(n) / n, "prompt_tokens": n, "out_tokens": out}


def _log_window(model, slower: float, t0: float, rng: random.Random, spread: float = 0.0) -> tuple[list[dict], float]:
    """Steps of a point that all ran `slower` times the profile's step model (each times a lognormal
    factor of mean 1 and spread `spread`): decode batches of 1-10 rows, every sixth step a prefill
    of 50-450 tokens; the first after the server idled (between points)."""
    lines, t = [], t0
    for i in range(90):
        if i % 6 == 5:
            pt = rng.choice([50, 120, 300, 450])
            shape = dict(mode="EXTEND", pt=pt, pr=1, pq=pt * pt / 2.0, dr=0, dc=0)
        else:
            dr = rng.randint(1, 10)
            shape = dict(mode="DECODE", pt=0, pr=0, pq=0.0, dr=dr, dc=dr * 150)
        period = slower * steplog.predicted_s(model, steplog.Step(t, 0.0, shape["mode"], shape["pt"], shape["pr"],
                                                                  shape["pq"], shape["dr"], shape["dc"]))
        if spread:
            period *= rng.lognormvariate(-spread ** 2 / 2, spread)
        lines.append({"t": t, "dur": 0.9 * period, "idle": i == 0, **shape})
        t += period
    return lines, t


def _live_run(tmp: Path, slower: float = SLOWER, spread: dict[str, float] | None = None) -> Path:
    """The run folder; `spread`: system -> how much its logged steps spread around the model."""
    base = resolve_profile(PROFILE)
    slow = validate.scaled(base, {"decode": slower, "prefill": slower}).with_server(kv_tokens=1536,
                                                                                   chunked_prefill_tokens=512)
    reqs = _requests()
    cfg = {"mode": "capacity", "kv_tokens": 1536, "chunked_prefill": 512, "requests": reqs, "model": str(tmp / "no-model"),
           "date_utc": "2026-11-29T00:00:00+00:00", "server_commands": COMMANDS, "pairs": [["sglang", "superinfer"]],
           "capacity_grid": {"target": GRID.target, "lo": GRID.lo, "hi": GRID.hi, "growth": GRID.growth,
                             "resolution": GRID.resolution, "stop_after": GRID.stop_after}}
    (tmp / "schedules").mkdir(parents=True)
    (tmp / "logs").mkdir()
    results: dict[str, list] = {"sglang": [], "superinfer": []}
    runs, t, rng = [], 1.8e9, random.Random(7)
    for k, seed in ((0, 1), (1, 2)):
        for system, policy in (("sglang", "sglang"), ("superinfer", "goodput")):
            config = validate.system_config(cfg, system, policy, 1536)

            def measure(rates, system=system, policy=policy, config=config, k=k, seed=seed):
                nonlocal t
                out = []
                for rate in rates:
                    if k == 0:  # the harness's schedule file (capacity_live.point_at)
                        plan = SimpleNamespace(seed=seed, requests=reqs, out_dir=tmp)
                        capacity_live.point_at(plan, rate, (100 if system == "sglang" else 200) + len(results[system]))
                    wl = recorded_workload(reqs, search_arrivals(N, rate, seed), "live")
                    att = simulate(wl, slow, policy, config)["both_attainment"]
                    met = round(att * N)
                    steps, t_end = _log_window(base.step, slower, t, rng, (spread or {}).get(system, 0.0))
                    with (tmp / "logs" / f"{system}.steps.jsonl").open("a") as f:
                        f.writelines(json.dumps(s) + "\n" for s in steps)
                    results[system].append({
                        "rate": rate, "repeat": k, "seed": seed, "window_unix": [t, t_end],
                        "speed_probe": _probe(base, slower),
                        "summary": {"joint_attainment": met / N},
                        "requests": {"success": [True] * N, "ttft_ms": [1.0] * met + [9e9] * (N - met),
                                     "ttft_slo_ms": [4000.0] * N, "gaps_met": [9] * N, "n_gaps": [9] * N}})
                    t = t_end + 5.0
                    out.append(met / N)
                return out

            runs.append({"system": system, "repeat": k, "seed": seed, **find_capacity(measure, GRID).as_dict()})
    doc = {"config": cfg, "results": results, "capacity_runs": runs,
           "calibration": {"speed": {"steps_ms": _probe(base, slower)["steps_ms"],
                                     "prefill_ms_per_token": _probe(base, slower)["prefill_ms_per_token"]},
                           "mean_prompt_tokens": 150, "probe_out_tokens": 16}}
    doc["capacity"] = capacity_stats.summarize(runs, [("sglang", "superinfer")], results)
    (tmp / "ab.json").write_text(json.dumps(doc))
    return tmp


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run = _live_run(tmp_path_factory.mktemp("capacity_fake"))
    return run, cv.check(run, PROFILE, **PLANNER)


def test_the_replayed_search_finds_the_measured_capacities(live: tuple[Path, dict]) -> None:
    _, rep = live
    assert [(r["system"], r["policy"]) for r in rep["rows"]] == [("sglang", "sglang"), ("superinfer", "goodput")]
    for row in rep["rows"]:
        assert row["speed"]["source"] == "steplog" and row["speed"]["decode"] == pytest.approx(SLOWER, rel=1e-4)
        assert row["speed"]["prefill"] == pytest.approx(SLOWER, rel=1e-4)
        assert row["config"]["mixed_chunk"] == (row["system"] == "superinfer")
        first, second = row["replay"]
        # repeat 0: the same requests, arrivals and speed as measured -> the same search
        assert first["capacity_req_s"] == pytest.approx(first["measured_req_s"])
        assert first["schedules_match"] is True
        assert all(sim == pytest.approx(live_att, abs=0.5 / N) for _, live_att, sim in first["at_measured_rates"])
        # repeat 1's requests live in repeat1/dataset.jsonl, readable only with the model's tokenizer
        assert "skipped" in second and row["replay_mean_req_s"] == pytest.approx(first["capacity_req_s"])
        assert row["planner_req_s"] and GRID.lo / 4 < row["planner_req_s"] < GRID.hi
        assert len(row["planner_vs_brackets"]) == 2 and set(row["planner_vs_brackets"]) <= {"below", "inside", "above"}
    assert rep["prefix_cache"].startswith("not modelled")  # no tokenizer here
    (pair,) = rep["pairs"]
    assert pair["a"] == "sglang" and pair["b"] == "superinfer" and pair["planner"] > 0
    stock, ours = (r["measured"]["per_repeat"] for r in rep["rows"])
    assert pair["measured"] == pytest.approx((ours[0] / stock[0] + ours[1] / stock[1]) / 2)
    stock_r0, ours_r0 = (r["replay"][0]["capacity_req_s"] for r in rep["rows"])
    assert pair["replay"] == pytest.approx(ours_r0 / stock_r0)


def test_every_speed_source_reads_the_same_machine(live: tuple[Path, dict]) -> None:
    run, _ = live
    doc = json.loads((run / "ab.json").read_text())
    base = resolve_profile(PROFILE)
    for source in ("steplog", "probes", "calibration"):
        prof, used = cv.speed_profile(base, doc, run / "ab.json", "sglang", None, source)
        assert used["source"] == source and used["decode"] == pytest.approx(SLOWER, rel=1e-4), source
        assert prof.server.kv_tokens == 1536 and prof.server.chunked_prefill_tokens == 512
        assert prof.step.base_s == pytest.approx(SLOWER * base.step.base_s, rel=1e-4)
    with pytest.raises(ValueError, match="no step log"):
        cv.speed_profile(base, doc, run / "ab.json", "sglang#2", None, "steplog")


def test_a_faster_machine_plans_more_per_replica(tmp_path: Path, live: tuple[Path, dict]) -> None:
    _, slow = live
    fast = cv.check(_live_run(tmp_path / "fast", slower=1.0), PROFILE, replay=False, **PLANNER)
    for a, b in zip(slow["rows"], fast["rows"]):
        assert b["planner_req_s"] > a["planner_req_s"], (a["system"], a["planner_req_s"], b["planner_req_s"])
        assert b["speed"]["decode"] == pytest.approx(1.0, rel=1e-4) and all(x.get("skipped") == "off" for x in b["replay"])


def test_a_search_below_its_grid_is_read_by_its_bracket() -> None:
    assert cv._in_ci(False, {"censored": ["below", None]}) == "n/a (1 below grid)"
    assert cv._in_ci(True, {"censored": [None, None]}) == "yes"


def test_positions_against_a_live_bracket() -> None:
    assert [cv._position(x, (1.0, 1.2)) for x in (0.9, 1.0, 1.1, 1.2)] == ["below", "inside", "inside", "above"]
    assert cv._position(0.5, (None, 1.2)) == "inside" and cv._position(1.3, (None, 1.2)) == "above"  # below the grid
    assert cv._position(9.0, (4.8, None)) == "inside" and cv._position(None, (1.0, 1.2)) is None


def test_the_planner_draws_the_runs_requests_and_classes() -> None:
    reqs = _requests() + [{**_requests()[0], "slo_class": "batch", "ttft_slo_ms": 60000.0}]
    mix = cv.classes(reqs)
    assert [(c.name, c.rate, c.ttft_s) for c in mix] == [("default", float(N), 4.0), ("batch", 1.0, 60.0)]
    pop = cv.population([(reqs[:3], [[1, 2, 3] + [9] * 70, [1, 2, 4] + [9] * 70, [1, 2, 3, 5] + [9] * 70])])
    assert [c for _, _, c in pop.rows] == [0, 2, 3]
    wl, _ = mix_workload((MixClass("x", 1.0, 4.0, 0.6),), 5.0, 20.0, seed=2, population=pop)
    assert wl.requests and all((r.prompt_tokens, r.output_tokens, r.cached_tokens) in pop.rows for r in wl.requests)
    with pytest.raises(AssertionError):
        Population(((10, 5, 10),))  # a prompt cannot be served from cache entirely


def test_cli_writes_the_report(live: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = live
    assert main(["validate-capacity", str(run), "--out", str(tmp_path), "--duration", "60", "--seeds", "1",
                 "--resolution", "0.1", "--no-replay", "--speed", "probes", "--as-planned"]) == 0
    text = capsys.readouterr().out
    assert "| sglang (sglang) |" in text and "superinfer / sglang: predicted" in text and "(probes)" in text
    assert "Planner settings: the planner's own" in text
    stem = f"sim_validate_capacity_{run.name}_probes_as_planned"
    assert json.loads((tmp_path / f"{stem}.json").read_text())["speed"] == "probes"
    assert (tmp_path / f"{stem}.md").read_text() == cv.markdown(json.loads((tmp_path / f"{stem}.json").read_text()))



def test_steps_spread_as_the_run_logged_them(tmp_path: Path) -> None:
    """Ours' logged steps spread ~20% around the model, stock's not at all: the speed reports each
    spread, the planner and the replay simulate ours' steps spread as much, and `jitter=False`
    leaves every step at the model's time."""
    run = _live_run(tmp_path, spread={"superinfer": 0.2})
    on = cv.check(run, PROFILE, **PLANNER)
    off = cv.check(run, PROFILE, jitter=False, **PLANNER)
    stock, ours = on["rows"]
    assert stock["speed"]["spread"] == pytest.approx(0.0, abs=1e-6) == stock["config"]["step_jitter"]
    assert 0.12 < ours["speed"]["spread"] < 0.3 and ours["config"]["step_jitter"] == ours["speed"]["spread"]
    assert [r["config"]["step_jitter"] for r in off["rows"]] == [0.0, 0.0]
    assert on["jitter"] is True and off["jitter"] is False
    assert "spread as each system logged" in cv.markdown(on) and "the model time each" in cv.markdown(off)
    # the same searches over another model of the steps: spread steps do not meet what exact ones do
    sims = [[sim for x in rep["rows"][1]["replay"] if "at_measured_rates" in x for _, _, sim in x["at_measured_rates"]]
            + [rep["rows"][1]["planner_req_s"]] for rep in (on, off)]
    assert sims[0] != sims[1]


def test_requests_that_could_stop_at_eos_are_replayed_at_the_lengths_the_model_decoded(tmp_path: Path) -> None:
    """ab_bench --no-ignore-eos: output_tokens in the run is the bound; the points hold the lengths."""
    bounds = [64, 32, 64, 48]
    reqs = [{**r, "output_tokens": b} for r, b in zip(_requests()[:4], bounds)]
    point = {"repeat": 0, "rate": 1.0, "requests": {"success": [True, True, True, False], "output_len": [10, 20, 64, 50]}}
    doc = {"config": {"ignore_eos": False}, "results": {"sglang": [point], "superinfer": [
        {"repeat": 0, "requests": {"success": [True] * 4, "output_len": [10, 22, 64, 7]}},
        {"repeat": 1, "requests": {"success": [True] * 4, "output_len": [30, 30, 30, 30]}}]}}  # another repeat
    rows, _ = cv.with_measured_outputs(doc, 0, reqs, None)
    # per request the median of the points that completed it (a failed one's length is not one)
    assert [r["output_tokens"] for r in rows] == [10, 21, 64, 7]
    assert [r["max_new_tokens"] for r in rows] == bounds
    assert [r["output_tokens"] for r in cv.with_measured_outputs(doc, 1, reqs, None)[0]] == [30, 30, 30, 30]
    fixed = {**doc, "config": {}}  # runs before --no-ignore-eos: fixed-length, as recorded
    assert cv.with_measured_outputs(fixed, 0, reqs, None)[0] is reqs
    short = {"repeat": 0, "requests": {"success": [True] * 3, "output_len": [1, 2, 3]}}
    with pytest.raises(ValueError, match="holds 3 requests"):
        served_rows(doc["config"], reqs, [short])
    pop = cv.population([(rows, None)])
    assert pop.bounds == tuple(bounds) and [o for _, o, _ in pop.rows] == [10, 21, 64, 7]
    wl, _ = mix_workload((MixClass("x", 1.0, 4.0, 0.6),), 5.0, 40.0, seed=2, population=pop)
    pairs = {(r.output_tokens, r.max_new_tokens) for r in wl.requests}
    assert pairs == {(10, 64), (21, 32), (64, 64), (7, 48)}  # each row keeps its own bound
    replayed = recorded_workload(rows, [0.1 * i for i in range(4)], "eos")
    assert [(r.output_tokens, r.max_new_tokens) for r in replayed.requests] == [(10, 64), (21, 32), (64, 64), (7, 48)]
    # sim validate (one point): that point's own lengths
    (tmp_path / "schedules").mkdir()
    (tmp_path / "schedules" / "00.json").write_text(json.dumps({"arrivals_s": [0.0, 0.1, 0.2, 0.3]}))
    eos_doc = {"config": {"ignore_eos": False, "requests": reqs}}
    wl = validate.ab_workload(eos_doc, tmp_path / "ab.json", 0, point=point)
    assert [(r.output_tokens, r.max_new_tokens) for r in wl.requests] == [(10, 64), (20, 32), (64, 64), (48, 48)]
    with pytest.raises(ValueError, match="could stop at EOS"):
        validate.ab_workload(eos_doc, tmp_path / "ab.json", 0)
    # the simulator then serves them as requests of unknown length: SGLang's decayed reserve, the learned share
    assert not validate.system_config({"server_commands": COMMANDS, "ignore_eos": False}, "sglang", "sglang",
                                      1536).ignore_eos
    assert validate.system_config({"server_commands": COMMANDS}, "sglang", "sglang", 1536).ignore_eos
    from superinfer_sgl.sim.plan import PlanSpec

    assert not PlanSpec(PROFILE, (), population=pop).config("goodput").ignore_eos
    assert PlanSpec(PROFILE, (), population=cv.population([(reqs, None)])).config("goodput").ignore_eos
    with pytest.raises(AssertionError):
        Population(((100, 20, 0),), bounds=(10,))  # a bound under the output
