"""Replay the A/B harness's exact workload (scripts/ab_bench.py -> results/ab_*/ab.json) and
compare the simulator with what the servers measured.

The replay uses the A/B's own requests (templated prompt lengths, output lengths, per-request SLOs),
its arrival schedules (schedules/NN.json beside ab.json), its KV budget and chunked-prefill size,
and a measured cost profile (profiles/cpu-smollm2-135m.json by default). Pass: for every system and
rate, TTFT and joint attainment within 10 points of the measurement and P50 TTFT within 25%.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from superinfer_sgl.sim.engine import SimConfig
from superinfer_sgl.sim.profile import Profile, resolve_profile
from superinfer_sgl.sim.runner import simulate
from superinfer_sgl.sim.workload import RequestSpec, Workload

# A/B system name -> simulator policy. "superinfer" is our runtime as it is today: LVF with
# synchronous batched copies (integration/rotation.py: engine.save / engine.load, no eager sync).
SYSTEM_POLICY = {"sglang": "sglang", "sglang-priority": "sglang-priority", "superinfer": "lvf-batched"}
ATTAINMENT_POINTS, P50_TTFT_REL = 10.0, 0.25


@dataclass(frozen=True)
class AbPoint:
    system: str
    rate: float
    index: int  # position in config.points (its schedule file is schedules/{index:02d}.json)
    summary: dict


def find_ab(path: Path) -> Path:
    """results/ab_cpu.json, a folder holding ab.json, or the ab.json itself."""
    if path.is_dir():
        path = path / "ab.json"
    if path.exists():
        return path
    candidates = sorted(path.parent.glob(path.stem + "*/ab.json"))
    if candidates:
        return candidates[0]
    raise FileNotFoundError(f"no A/B results at {path} (nor {path.parent}/{path.stem}*/ab.json)")


def ab_workload(doc: dict, ab_path: Path, index: int) -> Workload:
    cfg = doc["config"]
    sched = ab_path.parent / "schedules" / f"{index:02d}.json"
    arrivals = json.loads(sched.read_text())["arrivals_s"]
    reqs = cfg["requests"]
    if len(arrivals) != len(reqs):
        raise ValueError(f"{sched}: {len(arrivals)} arrivals for {len(reqs)} requests")
    specs = sorted(
        (RequestSpec(f"ab{i}", float(t), int(r["prompt_tokens"]), int(r["output_tokens"]),
                     float(r["ttft_slo_ms"]) / 1000.0, float(r["tbt_slo_ms"]) / 1000.0,
                     int(r.get("priority") or 0))
         for i, (t, r) in enumerate(zip(arrivals, reqs))),
        key=lambda s: s.arrival)
    return Workload(tuple(specs), f"A/B workload {ab_path} point {index} ({cfg.get('workload')})")


def ab_points(doc: dict) -> list[AbPoint]:
    labels = [p["label"] for p in doc["config"]["points"]]
    out = []
    for system, pts in doc["results"].items():
        for p in pts:
            out.append(AbPoint(system, float(p["rate"]), labels.index(p["label"]), p["summary"]))
    return out


def _measured(summary: dict) -> dict:
    p50 = summary.get("p50_ttft_ms")
    return {"ttft_attainment": summary.get("ttft_attainment"),
            "joint_attainment": summary.get("joint_attainment"),
            "tbt_gap_attainment": summary.get("tbt_gap_attainment"),
            "p50_ttft_s": None if p50 is None else p50 / 1000.0}


def _simulated(s: dict) -> dict:
    return {"ttft_attainment": s["ttft_attainment"], "joint_attainment": s["both_attainment"],
            "tbt_gap_attainment": s["tbt_gap_attainment"], "p50_ttft_s": s["ttft_p50_s"]}


def compare(measured: dict, simulated: dict) -> dict:
    d_ttft = 100 * (simulated["ttft_attainment"] - measured["ttft_attainment"])
    d_joint = 100 * (simulated["joint_attainment"] - measured["joint_attainment"])
    m, s = measured["p50_ttft_s"], simulated["p50_ttft_s"]
    rel = None if not m or s is None else s / m - 1.0
    ok = abs(d_ttft) <= ATTAINMENT_POINTS and abs(d_joint) <= ATTAINMENT_POINTS and rel is not None \
        and abs(rel) <= P50_TTFT_REL
    return {"ttft_points": d_ttft, "joint_points": d_joint, "p50_ttft_rel": rel, "pass": ok}


def validate(ab_path: Path, profile: Profile, policy_map: dict[str, str] | None = None) -> dict:
    ab_path = find_ab(ab_path)
    doc = json.loads(ab_path.read_text())
    cfg = doc["config"]
    prof = profile.with_server(kv_tokens=int(cfg["kv_tokens"]),
                               chunked_prefill_tokens=int(cfg["chunked_prefill"]) or None)
    mapping = {**SYSTEM_POLICY, **(policy_map or {})}
    rows = []
    for pt in ab_points(doc):
        policy = mapping.get(pt.system.split("#")[0])
        if policy is None:
            continue
        sim = simulate(ab_workload(doc, ab_path, pt.index), prof, policy, SimConfig())
        measured, simulated = _measured(pt.summary), _simulated(sim)
        rows.append({"system": pt.system, "policy": policy, "rate": pt.rate, "measured": measured,
                     "simulated": simulated, "delta": compare(measured, simulated),
                     "sim_rotations": sim["rotations_out"], "sim_retractions": sim["retractions"]})
    return {"ab": str(ab_path), "profile": profile.name, "profile_path": profile.path,
            "kv_tokens": prof.server.kv_tokens, "chunked_prefill": prof.server.chunked_prefill_tokens,
            "criteria": {"attainment_points": ATTAINMENT_POINTS, "p50_ttft_rel": P50_TTFT_REL},
            "rows": rows, "all_pass": bool(rows) and all(r["delta"]["pass"] for r in rows)}


def markdown(report: dict) -> str:
    lines = [f"Validation of {report['profile']} against {report['ab']} "
             f"(KV {report['kv_tokens']} tokens, chunked prefill {report['chunked_prefill']})", "",
             "| system (policy) | rate | TTFT att. meas / sim | joint att. meas / sim | P50 TTFT s meas / sim | pass |",
             "|---|---|---|---|---|---|"]
    f = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    g = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for r in report["rows"]:
        m, s = r["measured"], r["simulated"]
        lines.append(f"| {r['system']} ({r['policy']}) | {r['rate']:g} | {f(m['ttft_attainment'])} / "
                     f"{f(s['ttft_attainment'])} | {f(m['joint_attainment'])} / {f(s['joint_attainment'])} | "
                     f"{g(m['p50_ttft_s'])} / {g(s['p50_ttft_s'])} | {'yes' if r['delta']['pass'] else 'NO'} |")
    lines += ["", f"all pass: {report['all_pass']}"]
    return "\n".join(lines) + "\n"


def run(ab_path: Path, profile_name: str, out_dir: Path, policy_map: dict[str, str] | None = None) -> dict:
    from superinfer_sgl.sim.plots import plot_validation

    report = validate(ab_path, resolve_profile(profile_name), policy_map)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "sim_validate_" + Path(report["ab"]).parent.name
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(report))
    if report["rows"]:
        plot_validation(report["rows"], out_dir / f"{stem}.png")
    return report
