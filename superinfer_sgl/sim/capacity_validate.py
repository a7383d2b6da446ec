"""The capacity planner's one-replica answer against a live capacity run (`ab_bench.py --capacity`).

A live run (ab.json: `capacity_runs`, `capacity`, every measured point in `results`) measured each
system's SLO capacity per repeat. For each system this asks the simulator the same question, for
that system's policy (validate.SYSTEM_POLICY: sglang -> stock FCFS, superinfer -> its --policy),
with the run's own requests (prompt and output lengths, the chat template's prefix-cache hits,
SLOs), KV budget, chunked-prefill size, each server's launch settings (validate.system_config) and
the machine's speed while the run ran, from (`speed`):

  steplog      the system's own scheduler iterations over its points' windows
               (logs/<system>.steps.jsonl, sim/steplog.refit): the one-core paired condition itself
  probes       the mean of the speed probes before its points (validate.probe_scales)
  calibration  the run's opening probe (validate.speed_scales): in paired capacity mode the first
               (stock) server, pinned to its one core, probed before its partner started
  auto         the first of these the run has

and, from a step log, how much single steps spread around that speed (`jitter`, on by default:
SimConfig.step_jitter; a CPU's steps spread 10-25% within seconds, and the goodput policy, which
plans against deadlines, loses more to that than stock FCFS does).

Two answers per system:

  planner  sim/plan.py's replica_capacity: Poisson arrivals over `duration` s, lengths drawn from
           the run's requests, `seeds` seeds pooled, every class at the run's target: the steady
           state an operator would provision for
  replay   the live search itself in the simulator, per repeat: the repeat's N requests, the
           harness's arrivals at every rate asked (bench.workloads.search_arrivals), the run's grid
           and stop rule (sim/capacity.find_capacity); what N requests per point and the first
           crossing make of the same model. Needs each repeat's requests: repeat 0's are in ab.json,
           later repeats' come from repeat<k>/dataset.jsonl and the model's tokenizer

and at every rate the run measured, simulated against measured joint attainment.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from superinfer_sgl.bench import abfile
from superinfer_sgl.bench.workloads import search_arrivals
from superinfer_sgl.sim import steplog, validate
from superinfer_sgl.sim.capacity import CapacityGrid, find_capacity
from superinfer_sgl.sim.engine import SimConfig
from superinfer_sgl.sim.plan import MixClass, PlanSpec, Population, replica_capacity
from superinfer_sgl.sim.profile import Profile, resolve_profile
from superinfer_sgl.sim.runner import simulate
from superinfer_sgl.sim.workload import earlier_prefixes, recorded_workload, served_rows

SPEED_SOURCES = ("auto", "steplog", "probes", "calibration")
PLANNER_GROWTH = 1.25  # the planner's own grid ratio (sim capacity / plan default)


# ---- the run's requests ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _tokenizer(model: str) -> object | None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(model)


def repeat_requests(doc: dict, ab_path: Path, k: int) -> tuple[list[dict] | None, list[list[int]] | None]:
    """Repeat k's request rows (the harness's: prompt_tokens, output_tokens, ttft_slo_ms, tbt_slo_ms,
    ...) and their templated prompt ids (None without the dataset or the tokenizer). Repeat 0: ab.json's
    own rows; repeat k: repeat<k>/dataset.jsonl tokenized (None, None without the tokenizer)."""
    if k == 0:
        return doc["config"]["requests"], validate.ab_prompt_ids(doc, ab_path)
    dataset, model = ab_path.parent / f"repeat{k}" / "dataset.jsonl", doc["config"].get("model")
    tok = _tokenizer(model) if dataset.exists() and model and Path(model).exists() else None
    if tok is None:
        return None, None
    rows = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    ids = [validate.chat_ids(tok, r["messages"]) for r in rows]
    reqs = [{"prompt_tokens": len(i), "output_tokens": int(r["max_tokens"]),
             "ttft_slo_ms": float(r["custom_params"]["ttft_slo_ms"]), "tbt_slo_ms": float(r["custom_params"]["tbt_slo_ms"]),
             "slo_class": r["custom_params"].get("slo_class")} for i, r in zip(ids, rows)]
    return reqs, ids


def with_measured_outputs(doc: dict, k: int, reqs: list[dict] | None,
                          ids: list[list[int]] | None) -> tuple[list[dict] | None, list[list[int]] | None]:
    """Repeat k's rows as served (workload.served_rows over every system's points of the repeat)."""
    if reqs is None:
        return reqs, ids
    points = [p for pts in doc["results"].values() for p in pts if p.get("repeat", 0) == k]
    return served_rows(doc["config"], reqs, points), ids


def population(sets: Sequence[tuple[list[dict], list[list[int]] | None]]) -> Population:
    """Every repeat's requests as (prompt, output, cached) rows; cached = the longest prefix shared
    with an earlier request of its repeat (the template's system prefix and a little more); with
    each row's max_new_tokens where the requests could stop at EOS."""
    rows, bounds = [], []
    for reqs, ids in sets:
        cached = earlier_prefixes(ids) if ids else [0] * len(reqs)
        rows += [(int(r["prompt_tokens"]), int(r["output_tokens"]), min(c, int(r["prompt_tokens"]) - 1))
                 for r, c in zip(reqs, cached)]
        bounds += [int(r.get("max_new_tokens") or r["output_tokens"]) for r in reqs]
    eos = any(r.get("max_new_tokens") for reqs, _ in sets for r in reqs)
    return Population(tuple(rows), tuple(bounds) if eos else ())


def classes(reqs: Sequence[dict]) -> tuple[MixClass, ...]:
    """The requests' SLO classes, each at its share of the requests (the planner's total rate is
    what it searches; a class's `rate` here only sets its share)."""
    count: dict[tuple, int] = {}
    for r in reqs:
        key = (r.get("slo_class") or "default", float(r["ttft_slo_ms"]), float(r["tbt_slo_ms"]),
               float(r.get("weight") or 1.0))
        count[key] = count.get(key, 0) + 1
    names = [k[0] for k in count]
    return tuple(MixClass(name if names.count(name) == 1 else f"{name}@{ttft:g}/{tbt:g}", float(n),
                          ttft / 1000.0, tbt / 1000.0, weight)
                 for (name, ttft, tbt, weight), n in count.items())


# ---- the machine's speed -----------------------------------------------------------------------------
def speed_profile(base: Profile, doc: dict, ab_path: Path, system: str, repeats: Sequence[int] | None,
                  source: str = "auto") -> tuple[Profile, dict]:
    """`base` at the speed `system` ran at in `repeats` (None: all), with the run's KV budget and
    chunk; and what was used (source, decode and prefill factors, what the step log refit, and from
    a step log the spread of single steps around the refit model within 3 s buckets: `spread`,
    steplog.step_spread, None where too few steps were timed)."""
    assert source in SPEED_SOURCES, source
    cfg = doc["config"]
    limits = dict(kv_tokens=int(cfg["kv_tokens"]), chunked_prefill_tokens=int(cfg["chunked_prefill"]) or None)
    points = [p for p in doc["results"].get(system, []) if repeats is None or p.get("repeat", 0) in repeats]
    log = ab_path.parent / "logs" / f"{system.replace('#', '_')}.steps.jsonl"
    if source in ("auto", "steplog") and log.exists():
        steps = _steps(log)
        window = [s for p in points if p.get("window_unix") for s in steplog.in_window(steps, p["window_unix"])]
        found = steplog.refit(base.step, window)
        if found:
            step, sc = found
            info = {"source": "steplog", "decode": sc["decode"], "prefill": sc["prefill"], "refit": sc["refit"],
                    "steps": sc["steps"], "decode_p10_p90": sc["decode_p10_p90"],
                    "spread": steplog.step_spread(step, window)}
            return replace(base, step=step).with_server(**limits), info
    if source == "steplog":
        raise ValueError(f"{system}: no step log with enough steps at {log}")
    probed = [sc for p in points if p.get("speed_probe") and (sc := validate.probe_scales(base, p["speed_probe"]))]
    if source in ("auto", "probes") and probed:
        sc = {k: statistics.fmean(s[k] for s in probed) for k in ("decode", "prefill")}
        return validate.scaled(base, sc).with_server(**limits), {"source": "probes", **sc, "probes": len(probed)}
    if source == "probes":
        raise ValueError(f"{system}: no point probes in {ab_path}")
    sc = validate.speed_scales(base, doc.get("calibration"))
    if sc is None and source == "calibration":
        raise ValueError(f"no calibration probe in {ab_path}")
    return validate.scaled(base, sc).with_server(**limits), {"source": "calibration" if sc else "profile", **(sc or {})}


def _spread(used: dict, jitter: bool) -> float:
    """SimConfig.step_jitter for a speed `speed_profile` used: its step log's spread, or none."""
    return float(used.get("spread") or 0.0) if jitter else 0.0


@functools.lru_cache(maxsize=4)
def _steps(path: Path) -> list[steplog.Step]:
    return steplog.read_steps(path)


# ---- the simulator's answers -----------------------------------------------------------------------
def replay_attainment(prof: Profile, policy: str, config: SimConfig, reqs: list[dict], ids: list | None,
                      seed: int, rate: float) -> float:
    """Joint attainment of the repeat's requests at the live search's arrivals for `rate`."""
    wl = recorded_workload(reqs, search_arrivals(len(reqs), rate, seed), f"live search, {rate:g} req/s", ids)
    return float(simulate(wl, prof, policy, config)["both_attainment"])


def replay_search(prof: Profile, policy: str, config: SimConfig, reqs: list[dict], ids: list | None,
                  seed: int, grid: CapacityGrid) -> dict:
    cap = find_capacity(lambda rates: [replay_attainment(prof, policy, config, reqs, ids, seed, r) for r in rates], grid)
    return cap.as_dict()


def check(path: Path, profile: str = validate.DEFAULT_PROFILE, speed: str = "auto", duration: float = 600.0,
          seeds: int = 4, seed: int = 0, resolution: float = 0.02, processes: int = 1,
          policy_map: Mapping[str, str] | None = None, replay: bool = True, as_planned: bool = False,
          jitter: bool = True) -> dict:
    """The report (see the module's doc). `as_planned`: the planner with its own settings (every
    policy with mixed chunk, `Job`'s defaults) instead of each server's launch flags. `jitter`: the
    simulated steps spread as the system's logged ones did (SimConfig.step_jitter = the speed's
    `spread`; no step log: none), else every step takes the refit model's time."""
    ab_path = validate.find_ab(Path(path))
    doc = abfile.load(ab_path)
    cfg = doc["config"]
    if cfg.get("mode") != "capacity":
        raise ValueError(f"{ab_path}: not a capacity run (ab_bench.py --capacity)")
    if (cfg.get("slo_rule") or "gaps") != "gaps":
        raise ValueError(f"{ab_path}: searched under the {cfg['slo_rule']!r} TBT rule; the planner and the replay "
                         "answer under the server's (90% of gaps) only")
    live_grid = CapacityGrid(**cfg["capacity_grid"])
    grid = CapacityGrid(live_grid.target, live_grid.lo / 4, live_grid.hi * 2, PLANNER_GROWTH, resolution)
    measured = doc.get("capacity") or _summary(doc)
    runs = doc.get("capacity_runs") or []
    repeats = sorted({(int(r["repeat"]), int(r["seed"])) for r in runs})
    sets = {k: with_measured_outputs(doc, k, *repeat_requests(doc, ab_path, k)) for k, _ in repeats}
    have = [sets[k] for k in sorted(sets) if sets[k][0] is not None]
    mix = classes([r for reqs, _ in have for r in reqs])
    pop = population(have)
    base = resolve_profile(profile)
    rows = []
    for system in dict.fromkeys(r["system"] for r in runs):
        policy = validate.system_policy(cfg, system, policy_map)
        if policy is None:
            continue
        prof, used = speed_profile(base, doc, ab_path, system, None, speed)
        config = replace(validate.system_config(cfg, system, policy, prof.server.kv_tokens),
                         step_jitter=_spread(used, jitter))
        spec = PlanSpec(prof, mix, duration, seed, seeds, pop, None if as_planned else {policy: config})
        planned = replica_capacity(spec, policy, mix, grid, processes).capacity_req_s
        m = measured["systems"].get(system, {})
        row = {"system": system, "policy": policy, "speed": used,
               "config": {"mixed_chunk": config.mixed_chunk, "budget_blocks": config.budget_blocks,
                          "min_stint_s": config.min_stint_s, "running_reserve": config.running_reserve,
                          "step_jitter": config.step_jitter, "ttft_shedding": config.ttft_shedding,
                          "mix_prefill": config.mix_prefill},
               "planner_req_s": planned, "measured": m,
               "planner_in_request_ci": _inside(planned, m.get("request_ci")),
               "planner_in_repeat_ci": _inside(planned, m.get("repeat_ci")),
               "planner_vs_brackets": [_position(planned, b) for b in m.get("brackets") or []], "replay": []}
        for k, rseed in repeats:
            reqs, ids = sets[k]
            live = next((r for r in runs if r["system"] == system and int(r["repeat"]) == k), {})
            if reqs is None or not replay:
                row["replay"].append({"repeat": k, "skipped": "off" if not replay else
                                      "no requests: repeat<k>/dataset.jsonl and the model's tokenizer needed"})
                continue
            rprof, rused = speed_profile(base, doc, ab_path, system, [k], speed)
            rconfig = replace(config, step_jitter=_spread(rused, jitter))
            found = replay_search(rprof, policy, rconfig, reqs, ids, rseed, live_grid)
            pts = sorted((p for p in doc["results"].get(system, []) if p.get("repeat", 0) == k), key=lambda p: p["rate"])
            row["replay"].append({
                "repeat": k, "seed": rseed, "speed": rused, "capacity_req_s": found["capacity_req_s"],
                "bracket": found["bracket"], "censored": found["censored"], "points": found["points"],
                "measured_req_s": live.get("capacity_req_s"), "measured_bracket": live.get("bracket"),
                "at_measured_rates": [(p["rate"], p["summary"]["joint_attainment"],
                                       replay_attainment(rprof, policy, rconfig, reqs, ids, rseed, p["rate"])) for p in pts],
                "schedules_match": _schedules_match(ab_path, k, reqs, rseed, [p["rate"] for p in pts])})
        done = [r["capacity_req_s"] or 0.0 for r in row["replay"] if "capacity_req_s" in r]
        row["replay_mean_req_s"] = statistics.fmean(done) if done else None
        row["replay_in_request_ci"] = _inside(row["replay_mean_req_s"], m.get("request_ci"))
        rows.append(row)
    return {"run": str(ab_path), "profile": base.name, "speed": speed, "date_utc": cfg.get("date_utc"),
            "planner_settings": "the planner's own (mixed chunk for every policy)" if as_planned
            else "each server's launch flags (validate.system_config)", "jitter": jitter,
            "kv_tokens": cfg["kv_tokens"], "chunked_prefill": cfg["chunked_prefill"], "target": live_grid.target,
            "classes": [{"name": c.name, "share": c.rate / sum(x.rate for x in mix), "ttft_ms": 1000 * c.ttft_s,
                         "tbt_ms": 1000 * c.tbt_s} for c in mix],
            "requests_per_point": len(cfg["requests"]), "population": len(pop.rows),
            "eos": "requests could stop at EOS: each at the length the model decoded, the server seeing "
                   "only its bound (max_new_tokens)" if pop.bounds else None,
            "prefix_cache": "chat-templated prompts tokenized: shared prefixes reused" if any(ids for _, ids in have)
            else "not modelled (no dataset.jsonl or tokenizer): every prompt token computed",
            "planner": {"duration_s": duration, "seeds": seeds, "seed": seed, "grid": asdict(grid)},
            "live_grid": asdict(live_grid), "rows": rows, "pairs": _pairs(rows, measured)}


def _summary(doc: dict) -> dict:
    """The live summary of a run that has not finished (ab.json without `capacity`)."""
    from superinfer_sgl.bench.capacity_stats import summarize

    return summarize(doc.get("capacity_runs") or [], [tuple(p) for p in doc["config"].get("pairs") or []], doc["results"],
                     rule=doc["config"].get("slo_rule") or "gaps")


def _position(x: float | None, bracket: Sequence[float | None] | None) -> str | None:
    """Where x lies against a live search's bracket (highest passing, lowest failing rate; a search
    below its grid: (None, lowest rate), above it: (highest rate, None))."""
    if x is None or not bracket:
        return None
    lo, hi = bracket
    return "below" if lo is not None and x < lo else "above" if hi is not None and x >= hi else "inside"


def _inside(x: float | None, ci: Sequence[float] | None) -> bool | None:
    return None if x is None or not ci else bool(ci[0] <= x <= ci[1])


def _schedules_match(ab_path: Path, k: int, reqs: list[dict], seed: int, rates: Sequence[float]) -> bool | None:
    """The arrivals drawn again equal the schedules the live run wrote at its measured `rates`
    (None: none found; the calibration's own sweep points, 00..03.json, are not the search's)."""
    folder = ab_path.parent / ("schedules" if k == 0 else f"repeat{k}/schedules")
    seen = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))] if folder.exists() else []
    seen = [s for s in seen if s.get("rate") in rates and len(s["arrivals_s"]) == len(reqs)]
    if not seen:
        return None
    return all(s["arrivals_s"] == search_arrivals(len(reqs), s["rate"], seed) for s in seen)


def _pairs(rows: list[dict], measured: dict) -> list[dict]:
    by = {r["system"]: r for r in rows}
    out = []
    for p in measured.get("pairs", []):
        a, b = by.get(p["a"]), by.get(p["b"])
        if not a or not b:
            continue
        planned = b["planner_req_s"] / a["planner_req_s"] if a["planner_req_s"] and b["planner_req_s"] else None
        per = [y["capacity_req_s"] / x["capacity_req_s"] for x, y in zip(a["replay"], b["replay"])
               if x.get("capacity_req_s") and y.get("capacity_req_s") is not None]
        replayed = statistics.fmean(per) if per else None
        out.append({"a": p["a"], "b": p["b"], "measured": p["ratio"], "measured_per_repeat": p["per_repeat"],
                    "measured_request_ci": p["request_ci"], "measured_repeat_ci": p["repeat_ci"],
                    "planner": planned, "planner_in_request_ci": _inside(planned, p["request_ci"]),
                    "replay": replayed, "replay_per_repeat": per,
                    "replay_in_request_ci": _inside(replayed, p["request_ci"])})
    return out


# ---- report ------------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ci(ci: Sequence[float] | None, fmt: str = "{:.3f}") -> str:
    return "-" if not ci else f"{fmt.format(ci[0])} .. {fmt.format(ci[1])}"


def _yes(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "no")


def _in_ci(x: bool | None, m: dict) -> str:
    """A search below its grid counts 0 in the request interval (its capacity is somewhere under the
    lowest rate): against such a system, the interval cannot place a prediction; its bracket can."""
    below = sum(c == "below" for c in m.get("censored") or [])
    return f"n/a ({below} below grid)" if below else _yes(x)


def markdown(rep: dict) -> str:
    pl = rep["planner"]
    cls = "; ".join(f"{c['name']} {100 * c['share']:.0f}% at {c['ttft_ms']:g} / {c['tbt_ms']:g} ms" for c in rep["classes"])
    lines = [f"Capacity planner against the live capacity run {rep['run']} ({rep['date_utc']})", "",
             f"Profile {rep['profile']} at the run's speed (source per row); KV {rep['kv_tokens']} tokens, chunk "
             f"{rep['chunked_prefill']}; classes {cls}; target {100 * rep['target']:g}% joint. Planner: "
             f"{pl['duration_s']:g} s of Poisson arrivals x {pl['seeds']} seeds per rate, lengths drawn from the run's "
             f"{rep['population']} requests. Replay: the live search in the simulator, per repeat, with its "
             f"{rep['requests_per_point']} requests and arrivals per point. "
             + (f"Lengths: {rep['eos']}. " if rep.get("eos") else "")
             + f"Prefix cache: {rep['prefix_cache']}. "
             f"Planner settings: {rep['planner_settings']}. Steps: "
             f"{'spread as each system logged them (within 3 s)' if rep.get('jitter') else 'the model time each'}.", "",
             "| system (policy) | speed x decode / prefill (source) | planner req/s | replay per repeat | "
             "measured per repeat (bracket) | measured mean | 95% request | 95% repeat (t) | planner in request CI | "
             "planner vs each bracket | replay mean in request CI |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        sp, m = r["speed"], r["measured"]
        per = ", ".join(_f(x.get("capacity_req_s")) + (f" ({x['censored']})" if x.get("censored") else "")
                        if "capacity_req_s" in x else "skipped" for x in r["replay"])
        caps = m.get("per_repeat", [])
        live = ", ".join(f"{_f(c)} ({_f(b[0], '{:.3g}')}..{_f(b[1], '{:.3g}')})" if b else _f(c)
                         for c, b in zip(caps, m.get("brackets") or [None] * len(caps)))
        lines.append(f"| {r['system']} ({r['policy']}{', mixed chunk' if r['config']['mixed_chunk'] else ''}) | "
                     f"{_f(sp.get('decode'), '{:.2f}')} / {_f(sp.get('prefill'), '{:.2f}')} ({sp['source']}"
                     f"{'; steps spread ' + format(r['config']['step_jitter'], '.0%') if r['config'].get('step_jitter') else ''}) | "
                     f"{_f(r['planner_req_s'])} | {per} | {live} | "
                     f"{_f(m.get('mean_req_s'))} | {_ci(m.get('request_ci'))} | {_ci(m.get('repeat_ci'))} | "
                     f"{_in_ci(r['planner_in_request_ci'], m)} | "
                     f"{', '.join(x or '-' for x in r['planner_vs_brackets']) or '-'} | "
                     f"{_in_ci(r['replay_in_request_ci'], m)} |")
    lines.append("")
    for p in rep["pairs"]:
        replayed = ", ".join(f"{x:.2f}" for x in p["replay_per_repeat"]) or "-"
        measured = ", ".join(f"{x:.2f}" for x in p["measured_per_repeat"]) or "-"
        lines.append(f"{p['b']} / {p['a']}: predicted {_f(p['planner'], '{:.2f}x')} (planner), "
                     f"{_f(p['replay'], '{:.2f}x')} (replay; per repeat {replayed}); measured "
                     f"{_f(p['measured'], '{:.2f}x') if p['measured'] is not None else '- (a baseline at 0)'} "
                     f"(per repeat {measured}; "
                     f"95% request {_ci(p['measured_request_ci'], '{:.2f}')}); planner inside: "
                     f"{_yes(p['planner_in_request_ci'])}, replay inside: {_yes(p['replay_in_request_ci'])}")
    lines += ["", "Joint attainment at the rates the run measured, live / simulated (replay):", ""]
    for r in rep["rows"]:
        for x in r["replay"]:
            if "at_measured_rates" in x:
                seq = ", ".join(f"{rate:.3g}: {100 * live:.0f} / {100 * sim:.0f}%"
                                for rate, live, sim in x["at_measured_rates"])
                lines.append(f"- {r['system']}, repeat {x['repeat']} (speed x{x['speed'].get('decode', 0):.2f} / "
                             f"x{x['speed'].get('prefill', 0):.2f}, {x['speed']['source']}): {seq}")
    return "\n".join(lines) + "\n"


def run(path: Path, out_dir: Path, **kw: object) -> dict:
    rep = check(path, **kw)  # type: ignore[arg-type]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "sim_validate_capacity_" + Path(rep["run"]).parent.name
    if kw.get("speed", "auto") != "auto":
        stem += f"_{kw['speed']}"
    if kw.get("as_planned"):
        stem += "_as_planned"
    if kw.get("jitter") is False:
        stem += "_nojitter"
    (out_dir / f"{stem}.json").write_text(json.dumps(rep, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(rep))
    return rep


__all__ = ["SPEED_SOURCES", "check", "classes", "markdown", "population", "repeat_requests", "run", "speed_profile"]
