"""Replay the A/B harness's exact workload (scripts/ab_bench.py -> results/ab_*/ab.json) and
compare the simulator with what the servers measured.

The replay uses the A/B's own requests (templated prompt lengths, output lengths, per-request SLOs),
its arrival schedules (schedules/NN.json beside ab.json), its KV budget and chunked-prefill size,
and a measured cost profile (profiles/cpu-smollm2-135m.json by default). With `rescale`, each point
runs at the machine's speed while it was measured: from the servers' step logs where the A/B has
them (sim/steplog.py), else from its speed probes. Pass: for every system and rate, TTFT and joint
attainment within 10 points of the measurement and P50 TTFT within 25%.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from superinfer_sgl.bench import abfile
from superinfer_sgl.launch_checks import flag_value
from superinfer_sgl.rotasched.planner import rotation_budget
from superinfer_sgl.sim.engine import SimConfig
from superinfer_sgl.sim import steplog
from superinfer_sgl.sim.profile import Profile, resolve_profile
from superinfer_sgl.sim.runner import simulate
from superinfer_sgl.sim.workload import Workload, earlier_prefixes, recorded_workload, served_rows  # noqa: F401 (re-exported)

# A/B system name -> simulator policy. "superinfer" is our runtime as it is today: LVF over the
# rotation engine's one call per step for both directions, with eager sync (its defaults).
AS_SERVED = "as-served"  # our server: the simulator policy of its --policy flag (served_policy)
SYSTEM_POLICY = {"sglang": "sglang", "sglang-priority": "sglang-priority", "superinfer": AS_SERVED,
                 "superinfer-paper": AS_SERVED}
ATTAINMENT_POINTS, P50_TTFT_REL = 10.0, 0.25
RUNNING_RESERVE_SINCE = "2026-11-28"  # A/Bs dated before ran servers without --running-reserve
TTFT_SHEDDING_SINCE = "2026-11-30T12:28"  # ... and before this without TTFT shedding (c071d64)

# What the replay does not model of the servers that ran (scripts/ab_bench.py, superinfer today).
MODEL_GAPS = (
    "superinfer: prefetch (default on) copies rotary KV back one step ahead of the resume; the "
    "replay charges the copy in the resume's own step (on CPU a copy is ~1 ms: small either way)",
    "superinfer: the server's own work per rotation (rotate-out, restore into the radix tree, "
    "re-admission, the slower mixed iteration) is one measured constant (profile step.per_resume_s), "
    "not a function of the batch",
    "all systems: HTTP, tokenizer and detokenizer time and the overlap scheduler's CPU/GPU overlap "
    "are only in the profile's fitted intercepts",
    "all systems: the shared prompt prefix stays in the radix cache (never evicted) and is allocated "
    "once; prefixes shared beyond it are reused only as far as the first request's tokens go",
    "all systems: a mixed chunk costs what the additive step model says (prefill tokens plus decode "
    "rows); its real cost was not measured separately",
)


@dataclass(frozen=True)
class AbPoint:
    system: str
    rate: float
    index: int  # position in config.points (its schedule file is schedules/{index:02d}.json)
    summary: dict


def find_ab(path: Path) -> Path:
    """results/ab_cpu.json, a folder holding ab.json (or ab.json.gz), or the file itself."""
    if path.is_dir():
        try:
            return abfile.find(path)
        except FileNotFoundError:
            path = path / abfile.PLAIN
    if path.exists():
        return path
    candidates = sorted(c for name in (abfile.PLAIN, abfile.GZIP) for c in path.parent.glob(f"{path.stem}*/{name}"))
    if candidates:
        return candidates[0]
    raise FileNotFoundError(f"no A/B results at {path} (nor {path.parent}/{path.stem}*/ab.json)")


def ab_workload(doc: dict, ab_path: Path, index: int,
                prompt_ids: Sequence[Sequence[int]] | None = None, point: dict | None = None) -> Workload:
    """The A/B point's requests at their measured arrival times (workload.recorded_workload: with
    the prompts' ids, each request's longest prefix shared with an earlier arrival is cached, as
    SGLang's radix cache finds it); requests that could stop at EOS at the lengths `point` decoded."""
    cfg = doc["config"]
    sched = ab_path.parent / "schedules" / f"{index:02d}.json"
    arrivals = json.loads(sched.read_text())["arrivals_s"]
    if len(arrivals) != len(cfg["requests"]):
        raise ValueError(f"{sched}: {len(arrivals)} arrivals for {len(cfg['requests'])} requests")
    if not cfg.get("ignore_eos", True) and not (point and point.get("requests")):
        raise ValueError(f"{ab_path} point {index}: its requests could stop at EOS; no measured point gives their lengths")
    rows = served_rows(cfg, cfg["requests"], [point] if point else [])
    return recorded_workload(rows, arrivals, f"A/B workload {ab_path} point {index} ({cfg.get('workload')})",
                             prompt_ids)


def ab_prompt_ids(doc: dict, ab_path: Path) -> list[list[int]] | None:
    """Token ids of the A/B's prompts (dataset.jsonl beside ab.json) as the server's chat
    template makes them; None when the dataset or the model's tokenizer is not here."""
    dataset = ab_path.parent / "dataset.jsonl"
    model = doc["config"].get("model")
    if not dataset.exists() or not model or not Path(model).exists():
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    tok = AutoTokenizer.from_pretrained(model)
    reqs = doc["config"]["requests"]
    rows = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    if len(rows) != len(reqs) or not all("messages" in r for r in rows):
        return None
    ids = [chat_ids(tok, r["messages"]) for r in rows]
    # The harness recorded each templated prompt's length: the ids must be the server's.
    if any(len(i) != int(r["prompt_tokens"]) for i, r in zip(ids, reqs)):
        return None
    return ids


def chat_ids(tok: object, messages: list[dict]) -> list[int]:
    """Token ids of a chat-templated prompt. transformers 5 returns a BatchEncoding, 4 a list."""
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc
    return [int(x) for x in ids]


def ab_points(doc: dict) -> list[AbPoint]:
    """One point per system and rate: repeat 0's (its files are the ones beside ab.json) and, in
    paired mode where ours ran beside each baseline, its first run."""
    labels = [p["label"] for p in doc["config"]["points"]]
    out, seen = [], set()
    for system, pts in doc["results"].items():
        for p in pts:
            if p.get("repeat", 0) != 0 or (system, p["rate"]) in seen:
                continue
            seen.add((system, p["rate"]))
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


def system_config(cfg: dict, system: str, policy: str, kv_tokens: int) -> SimConfig:
    """The simulator settings that match how `system`'s server was launched.

    Rotation quantum: --min-stint-ms (absent: 0, the servers before the option).
    Mixed chunk: SGLang's --enable-mixed-chunk, which our launcher adds for rotasched unless
    --no-mixed-resume (launch_server.prepare); --mix-prefill as given. TTFT shedding:
    --[no-]ttft-shedding as given, else the default (off in A/Bs dated before it). Requests that
    could stop at EOS (ab_bench --no-ignore-eos): ignore_eos False. Rotation
    budget: --rotation-budget-blocks, else the runtime's auto value
    (rotasched.planner.rotation_budget) without its measured link bound: an eighth of the pool in
    rotation blocks, at most the paper's 2400, at least 1 (on the CPU the link moves far more than
    the cap in one step, so the cap is what the server used). Without the A/B's command lines:
    SimConfig's defaults.
    """
    cmd = [str(a) for a in (cfg.get("server_commands") or {}).get(system, [])]
    if not cmd:
        return SimConfig()  # an older A/B file without its command lines: the defaults
    ours = "superinfer_sgl.launch_server" in cmd
    mixed = "--enable-mixed-chunk" in cmd or (
        ours and flag_value(cmd, "--scheduler") != "sglang" and "--no-mixed-resume" not in cmd)
    bt = int(flag_value(cmd, "--rotary-block-tokens") or 16)
    budget = flag_value(cmd, "--rotation-budget-blocks")
    blocks = rotation_budget(int(budget) if budget is not None else None, kv_tokens, bt)
    # The harness spelled out --min-stint-ms while the paper policy was the only one; since
    # --policy exists it spells that out and leaves the quantum to its policy's default. An A/B
    # with neither ran a server that had no rotation quantum.
    stint = flag_value(cmd, "--min-stint-ms")
    quantum = float(stint) / 1000.0 if stint is not None else (
        None if flag_value(cmd, "--policy") is not None else 0.0)
    # --running-reserve: as given, else the policy's (before the option: SGLang's whole reserve, 1)
    reserve = flag_value(cmd, "--running-reserve")
    share = float(reserve) if reserve not in (None, "auto") else (
        1.0 if str(cfg.get("date_utc", "")) < RUNNING_RESERVE_SINCE else None)
    dated = str(cfg.get("date_utc", ""))
    shedding = False if "--no-ttft-shedding" in cmd else True if "--ttft-shedding" in cmd else (
        SimConfig.ttft_shedding and dated >= TTFT_SHEDDING_SINCE)
    return SimConfig(budget_blocks=blocks, block_tokens=bt, mixed_chunk=mixed, min_stint_s=quantum,
                     running_reserve=share, ttft_shedding=shedding,
                     mix_prefill=flag_value(cmd, "--mix-prefill") or SimConfig.mix_prefill,
                     ignore_eos=bool(cfg.get("ignore_eos", True)))


def system_policy(cfg: dict, system: str, policy_map: Mapping[str, str] | None = None) -> str | None:
    """The simulator policy `system` is replayed with: by its name in `policy_map`, else in
    SYSTEM_POLICY ("sglang#2", the harness's second stock server, as "sglang"), else, for our
    launcher under another name (ab_bench.py --variant's superinfer-NAME), the policy it served
    (SGLang's with --scheduler sglang); AS_SERVED resolves through `served_policy`. None: a
    system the simulator does not model."""
    mapping = {**SYSTEM_POLICY, **(policy_map or {})}
    policy = mapping.get(system, mapping.get(system.split("#")[0]))
    cmd = [str(a) for a in (cfg.get("server_commands") or {}).get(system, [])]
    if policy is None and "superinfer_sgl.launch_server" in cmd:
        policy = "sglang" if flag_value(cmd, "--scheduler") == "sglang" else AS_SERVED
    return served_policy(cfg, system) if policy == AS_SERVED else policy


def served_policy(cfg: dict, system: str) -> str:
    """The simulator policy of our server as launched: `goodput` or `paper` from --policy (the
    paper's rule, `lvf-duplex`, for A/Bs from before the option)."""
    cmd = [str(a) for a in (cfg.get("server_commands") or {}).get(system, [])]
    return flag_value(cmd, "--policy") or "lvf-duplex"


DEFAULT_PROFILE = "cpu-smollm2-135m"  # what --validate uses unless told otherwise
PROBE_OUT_TOKENS = 24  # bench.calibrate.probe's default: decode gaps come from 24-token outputs


def speed_scales(profile: Profile, calibration: dict | None) -> dict | None:
    """How much slower (> 1) or faster the machine was during the A/B than during profiling, from
    the A/B's own speed probe of the stock server (bench.calibrate.probe: one lone request's TTFT
    for the mean prompt, median decode gaps at batch 1, 4, 8). A shared machine drifts by tens of
    percent over an hour; the probe runs minutes before the sweep. Decode: mean ratio of the probe's
    gaps to the profile's step times; prefill: the same for the lone TTFT, its decode-base part
    scaled like decode. None without a probe."""
    speed = (calibration or {}).get("speed") or {}
    steps, per_tok = speed.get("steps_ms"), speed.get("prefill_ms_per_token")
    prompt = (calibration or {}).get("mean_prompt_tokens")
    if not steps or not per_tok or not prompt:
        return None
    step, n = profile.step, int(prompt)
    ctx = n + int(calibration.get("probe_out_tokens") or PROBE_OUT_TOKENS) // 2  # type: ignore[union-attr]
    decode = sum(ms / 1000.0 / step.seconds(decode_reqs=b, decode_context=b * ctx) for b, ms in steps) / len(steps)
    ttft = per_tok * n / 1000.0 - profile.server.request_overhead_s
    base = step.base_s
    prefill = (ttft - base * decode) / (step.prefill_alone(n) - base)
    return {"decode": decode, "prefill": prefill}


STEP_LOG_USES = ("trace", "refit", "scale", "jitter")  # what --rescale takes from a step log (ablations: docs/sim.md)


def point_profile(profile: Profile, ab_path: Path, system: str, point: dict, first_arrival_s: float = 0.0,
                  use: str = "trace") -> tuple[Profile | None, dict | None, str | None]:
    """The profile at a point's own speed. From the server's step log over the point's window
    (the harness's servers log every iteration): use "scale" two factors, "refit" the step
    model refit to the window, "trace" that plus the machine's speed over the point in 3 s
    buckets (scales['trace'], for SimConfig.speed_trace), "jitter" that plus the spread of single
    steps within those buckets (scales['spread'], for SimConfig.step_jitter). Else scaled to the probe run right
    before the point. (None, None, None) when the point has neither."""
    assert use in STEP_LOG_USES, use
    log = ab_path.parent / "logs" / f"{system.replace('#', '_')}.steps.jsonl"
    if point.get("window_unix") and log.exists():
        window = steplog.in_window(_steps(log), point["window_unix"])
        found = steplog.refit(profile.step, window)
        if found and use == "scale":
            return scaled(profile, found[1]), {**found[1], "refit": []}, "step log"
        if found:
            step, scales = found
            t0 = steplog.bench_start(window, first_arrival_s, profile.server.request_overhead_s)
            traced = t0 is not None and use in ("trace", "jitter")
            trace = steplog.speed_trace(step, window, t0) if traced else ()
            spread = steplog.step_spread(step, window) if use == "jitter" else None
            return replace(profile, step=step), {**scales, "trace": trace, "spread": spread}, "step log"
    probed = point.get("speed_probe")
    if probed:
        scales = probe_scales(profile, probed)
        return scaled(profile, scales), scales, "point probe"
    return None, None, None


def probe_scales(profile: Profile, probed: dict) -> dict | None:
    """speed_scales of one point's speed probe (a run's `speed_probe`: lone TTFT, gaps at 1 and 4)."""
    return speed_scales(profile, {"speed": probed, "mean_prompt_tokens": probed["prompt_tokens"],
                                  # the first A/B with point probes did not record it: 16
                                  "probe_out_tokens": probed.get("out_tokens", 16)})


@functools.lru_cache(maxsize=8)
def _steps(path: Path) -> list[steplog.Step]:
    return steplog.read_steps(path)


def scaled(profile: Profile, scales: dict | None) -> Profile:
    """The profile with its decode-side costs (base, per decode row, per context token, per
    resume) times scales['decode'] and its prefill-side costs times scales['prefill']."""
    if not scales:
        return profile
    st, d, f = profile.step, scales["decode"], scales["prefill"]
    step = replace(st, base_s=st.base_s * d, per_decode_token_s=st.per_decode_token_s * d,
                   per_context_token_s=st.per_context_token_s * d, per_resume_s=st.per_resume_s * d,
                   prefill_base_s=st.prefill_base_s * f, per_prefill_token_s=st.per_prefill_token_s * f,
                   per_prefill_pair_s=st.per_prefill_pair_s * f, per_prefill_req_s=st.per_prefill_req_s * f)
    return replace(profile, step=step)


def validate(ab_path: Path, profile: Profile, policy_map: dict[str, str] | None = None,
             rescale: bool = False, step_log_use: str = "trace") -> dict:
    ab_path = find_ab(ab_path)
    doc = abfile.load(ab_path)
    cfg = doc["config"]
    scales = speed_scales(profile, doc.get("calibration")) if rescale else None
    server_limits = dict(kv_tokens=int(cfg["kv_tokens"]), chunked_prefill_tokens=int(cfg["chunked_prefill"]) or None)
    prof = scaled(profile, scales).with_server(**server_limits)
    prompt_ids = ab_prompt_ids(doc, ab_path)
    rows = []
    results = doc["results"]
    for pt in ab_points(doc):
        policy = system_policy(cfg, pt.system, policy_map)
        if policy is None:
            continue
        point = next((p for p in results[pt.system] if p["rate"] == pt.rate and p.get("repeat", 0) == 0), {})
        # --rescale (a shared machine drifts within minutes): to the speed of the point's own
        # iterations where the server logged them, else to the probe right before the point, else
        # to the A/B's opening probe
        workload = ab_workload(doc, ab_path, pt.index, prompt_ids, point)
        pt_prof, pt_scales, source = point_profile(profile, ab_path, pt.system, point, workload.requests[0].arrival,
                                                    step_log_use) \
            if rescale and workload.requests else (None,) * 3
        if pt_prof is None:
            pt_prof, pt_scales, source = prof, scales, "opening probe" if scales else "profile as measured"
        pt_prof = pt_prof.with_server(**server_limits)
        config = replace(system_config(cfg, pt.system, policy, pt_prof.server.kv_tokens),
                         speed_trace=tuple((pt_scales or {}).get("trace") or ()),
                         step_jitter=(pt_scales or {}).get("spread") or 0.0)
        sim = simulate(workload, pt_prof, policy, config)
        measured, simulated = _measured(pt.summary), _simulated(sim)
        counters = point.get("counters") or {}
        rows.append({"system": pt.system, "policy": policy, "rate": pt.rate, "measured": measured,
                     "simulated": simulated, "delta": compare(measured, simulated),
                     "mixed_chunk": config.mixed_chunk, "budget_blocks": config.budget_blocks,
                     "measured_rotations": counters.get("rotations"),
                     "sim_rotations": sim["rotations_out"], "sim_retractions": sim["retractions"],
                     "speed_scales": pt_scales, "speed_source": source})
    twins = twin_agreement(doc)
    for r in rows:
        # A rate is judgeable when the stock server and its twin agree within the criterion: where
        # two runs of the same server differ by more, no replay can pass against both.
        r["judgeable"] = twins.get(r["rate"], {}).get("pass") if twins else None
    judged = [r for r in rows if r["judgeable"]]
    return {"ab": str(ab_path), "profile": profile.name, "profile_path": profile.path,
            "kv_tokens": prof.server.kv_tokens, "chunked_prefill": prof.server.chunked_prefill_tokens,
            "criteria": {"attainment_points": ATTAINMENT_POINTS, "p50_ttft_rel": P50_TTFT_REL},
            "noise_band": doc.get("noise_band"), "twin_agreement": twins, "model_gaps": list(MODEL_GAPS),
            "prefix_cache": "chat-templated prompts tokenized: shared prefixes reused" if prompt_ids
            else "not modelled (no dataset.jsonl or tokenizer): every prompt token computed",
            "per_resume_s": prof.step.per_resume_s, "speed_scales": scales,
            "rows": rows, "all_pass": bool(rows) and all(r["delta"]["pass"] for r in rows),
            "judgeable_pass": (bool(judged) and all(r["delta"]["pass"] for r in judged)) if twins else None}


def twin_agreement(doc: dict) -> dict[float, dict]:
    """Per rate, the stock server against its twin ("sglang" vs "sglang#2") under the same
    criterion as the replay (twin as 'simulated'). Empty without a twin."""
    results = doc.get("results", {})
    twin = next((k for k in results if k.startswith("sglang#")), None)
    if twin is None or "sglang" not in results:
        return {}
    base = {p["rate"]: p["summary"] for p in results["sglang"] if p.get("repeat", 0) == 0
            and p.get("paired_with") in (None, twin)}
    out = {}
    for p in results[twin]:
        if p["rate"] not in base or p.get("repeat", 0) != 0:
            continue
        a, b = _measured(base[p["rate"]]), _measured(p["summary"])
        if None in (a["ttft_attainment"], b["ttft_attainment"], a["joint_attainment"], b["joint_attainment"]):
            continue
        out[float(p["rate"])] = compare(a, b)
    return out


def markdown(report: dict) -> str:
    sc = report.get("speed_scales")
    sources = sorted({r.get("speed_source") for r in report["rows"]} & {"point probe", "step log"})
    per_point = bool(sources)
    traced = any((r.get("speed_scales") or {}).get("trace") for r in report["rows"])
    speed = (f"; profile speed per point, from its {' or '.join(sources)} (decode / prefill factors per row"
             + ("; step-log points also follow their 3 s speed trace)" if traced else ")")
             if per_point
             else f"; profile speed scaled to the A/B's probe: decode x{sc['decode']:.2f}, prefill "
             f"x{sc['prefill']:.2f}" if sc else "; profile speed as measured")
    lines = [f"Validation of {report['profile']} against {report['ab']} "
             f"(KV {report['kv_tokens']} tokens, chunked prefill {report['chunked_prefill']}{speed}; "
             f"prefix cache: {report.get('prefix_cache', '-')})", "",
             "| system (policy) | rate | TTFT att. meas / sim | joint att. meas / sim | P50 TTFT s meas / sim "
             "| rotations meas / sim |" + (" speed x dec / pre |" if per_point else "") + " pass |",
             "|---|---|---|---|---|---|" + ("---|" if per_point else "") + "---|"]
    f = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    g = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    n = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    for r in report["rows"]:
        m, s = r["measured"], r["simulated"]
        policy = r["policy"] + (", mixed chunk" if r.get("mixed_chunk") else "")
        rot = f"{n(r.get('measured_rotations'))} / {r['sim_rotations']}" if r["policy"].startswith("lvf") else "-"
        lines.append(f"| {r['system']} ({policy}) | {r['rate']:g} | {f(m['ttft_attainment'])} / "
                     f"{f(s['ttft_attainment'])} | {f(m['joint_attainment'])} / {f(s['joint_attainment'])} | "
                     f"{g(m['p50_ttft_s'])} / {g(s['p50_ttft_s'])} | {rot} | " + (
                     f"{r['speed_scales']['decode']:.2f} / {r['speed_scales']['prefill']:.2f}"
                     f"{'*' if r['speed_scales'].get('refit') else ''} | "
                     if per_point and r.get("speed_scales") else "- | " if per_point else "")
                     + f"{'yes' if r['delta']['pass'] else 'NO'} |")
    if any((r.get("speed_scales") or {}).get("refit") for r in report["rows"]):
        lines += ["", "\\* the step model's decode and/or prefill slopes refit to the point's own steps "
                  "(sim/steplog.py `refit`); the factors are the ratios of measured to profiled step time"]
    lines += ["", f"all pass: {report['all_pass']}"]
    twins = report.get("twin_agreement") or {}
    if twins:
        lines += ["", "Stock server vs its twin (same criterion; a rate where they disagree cannot judge a replay):",
                  "", "| rate | TTFT att. points | joint att. points | P50 TTFT rel. | twins agree |",
                  "|---|---|---|---|---|"]
        for rate, d in sorted(twins.items()):
            rel = "-" if d["p50_ttft_rel"] is None else f"{100 * d['p50_ttft_rel']:+.0f}%"
            lines.append(f"| {rate:g} | {d['ttft_points']:+.1f} | {d['joint_points']:+.1f} | {rel} | "
                         f"{'yes' if d['pass'] else 'NO'} |")
        lines += ["", f"pass at the rates where the twins agree: {report.get('judgeable_pass')}"]
    band = report.get("noise_band") or {}
    if band:
        keys = [k for k in ("ttft_attainment", "joint_attainment", "p50_ttft_ms") if k in band]
        lines += ["", "A/B noise band (largest |stock - stock twin| over rates): "
                  + ", ".join(f"{k} {band[k]:.1f}" for k in keys)]
    if report.get("model_gaps"):
        lines += ["", "Not modelled:"] + [f"- {x}" for x in report["model_gaps"]]
    return "\n".join(lines) + "\n"


def run(ab_path: Path, profile_name: str, out_dir: Path, policy_map: dict[str, str] | None = None,
        rescale: bool = False) -> dict:
    from superinfer_sgl.sim.plots import plot_validation

    report = validate(ab_path, resolve_profile(profile_name), policy_map, rescale)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "sim_validate_" + Path(report["ab"]).parent.name
    if profile_name != DEFAULT_PROFILE:  # other profiles and what-ifs do not overwrite the default report
        stem += "_" + Path(profile_name).stem
    if rescale:
        stem += "_rescaled"
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(report))
    if report["rows"]:
        plot_validation(report["rows"], out_dir / f"{stem}.png")
    return report
