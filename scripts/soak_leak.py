"""Leak check for a long soak (issue 38): every minute, the memory of every server process (RSS,
USS, anonymous, locked / pinned) and the host pool's occupancy; at the end, a least-squares slope
of each process's memory after a warm-up, with its 95% interval, against a stated bound on USS
(why USS: `verdict`), and a small plot. Also a sidecar / re-analysis command (`main`).

Why a slope and not a peak: a server under steady overload holds a steady working set (queued
requests, radix cache, allocator arenas), so its memory rises during the warm-up and then
flattens; a leak keeps rising. The bound (--leak-bound-mb-h, default 20 MB/h per process) is below
what leaking one small object per request would cost: at ~5 completions per second a leak of
1 KiB per request grows ~18 MB/h, and one request's own state (SGLang's Req, our RequestState,
its rid strings) is several KiB; a 2 GB scheduler growing 20 MB/h takes over four days to grow by
half. The verdict uses the slope's point estimate; the interval is reported so a reader can tell a
flat series from a noisy one.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import requests

DEFAULT_BOUND_MB_H = 20.0
HOST_SERIES = ("superinfer_host_pool_blocks_used", "superinfer_host_pool_blocks_total",
               "superinfer_rotary_requests", "sglang:num_running_reqs", "sglang:num_queue_reqs",
               "sglang:token_usage", "superinfer_rotations_out_total", "superinfer_resumes_total",
               "superinfer_recompute_fallbacks_total", "superinfer_aborted_rotary_total")


def role(p: psutil.Process) -> str:
    """A stable name for one server process: scheduler (with its rank suffix, e.g. scheduler_TP1),
    detokenizer, launcher (SGLang's HTTP server runs in it), resource_tracker, or its own name."""
    name = p.name()
    if name.startswith("sglang::"):
        cmd = " ".join(p.cmdline()).strip()  # the full title: comm is cut at 15 characters
        return (cmd if cmd.startswith("sglang::") else name)[len("sglang::"):].split()[0]
    cmd = " ".join(p.cmdline())
    if "launch_server" in cmd:
        return "launcher"
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return name


def _status_kib(pid: int, key: str) -> int:
    """A field of /proc/PID/status in KiB (VmLck: mlocked, VmPin: pinned pages; 0 if absent)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def sample_processes(root_pid: int) -> dict[str, dict[str, float]]:
    """RSS, USS (memory only this process holds) and locked / pinned MiB of each process in the tree."""
    out: dict[str, dict[str, float]] = {}
    root = psutil.Process(root_pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            full = p.memory_full_info()
            key = role(p)
            if key in out:
                key = f"{key}#{p.pid}"
            out[key] = {"pid": p.pid, "rss_mib": full.rss / 2**20, "uss_mib": full.uss / 2**20,
                        # RssAnon: heap and other anonymous memory (a second view of a leak)
                        "anon_mib": _status_kib(p.pid, "RssAnon") / 1024,
                        "locked_mib": (_status_kib(p.pid, "VmLck") + _status_kib(p.pid, "VmPin")) / 1024}
        except psutil.Error:
            continue
    return out


def host_series(url: str) -> dict[str, float]:
    """The host pool and queue series from /metrics, summed over label sets."""
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(HOST_SERIES):
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            if name in HOST_SERIES:
                out[name] = out.get(name, 0.0) + float(value)
    return out


class LeakSampler(threading.Thread):
    """Samples every `every_s` seconds (the first at once) until stopped; `root_pid` and `url` are
    read on each sample, so a restarted server is followed (its processes get new pids, and the
    slope is then fitted per pid-stable series only: see `slopes`)."""

    def __init__(self, root_pid: Callable[[], int], url: Callable[[], str], every_s: float = 60.0,
                 out_dir: Path | None = None) -> None:
        super().__init__(daemon=True)
        self.root_pid, self.url, self.every_s, self.out_dir = root_pid, url, every_s, out_dir
        self.stop_event = threading.Event()
        self.t0 = time.time()
        self.samples: list[dict[str, Any]] = []

    def sample(self) -> None:
        row: dict[str, Any] = {"t_s": round(time.time() - self.t0, 1)}
        try:
            row["procs"] = sample_processes(self.root_pid())
        except psutil.Error:
            row["procs"] = {}
        try:
            row["host"] = host_series(self.url())
        except requests.RequestException:
            row["host"] = {}
        self.samples.append(row)
        if self.out_dir is not None:  # as it goes: an hour's samples survive a crash of the soak
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "samples.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def run(self) -> None:
        self.sample()
        while not self.stop_event.wait(self.every_s):
            self.sample()


def slopes(samples: list[dict[str, Any]], warmup_s: float, field: str = "rss_mib") -> dict[str, dict[str, Any]]:
    """Per process (same role and pid throughout): least-squares slope of `field` (MiB) in MB/h
    after the warm-up, with the 95% interval of the slope (Student t on the fit's standard error)."""
    from scipy import stats

    series: dict[str, list[tuple[float, float, int]]] = {}
    for row in samples:
        if row["t_s"] < warmup_s:
            continue
        for key, p in row["procs"].items():
            if field in p:
                series.setdefault(key, []).append((row["t_s"] / 3600, p[field] * 2**20 / 1e6, p["pid"]))
    out: dict[str, dict[str, Any]] = {}
    for key, pts in series.items():
        pids = {pid for *_, pid in pts}
        if len(pts) < 3 or len(pids) != 1:
            out[key] = {"n": len(pts), "note": "fewer than 3 samples or the pid changed: no fit"}
            continue
        t, mb = [x for x, _, _ in pts], [y for _, y, _ in pts]
        fit = stats.linregress(t, mb)
        half = stats.t.ppf(0.975, len(pts) - 2) * fit.stderr if math.isfinite(fit.stderr) else 0.0
        out[key] = {"n": len(pts), "pid": pids.pop(), "slope_mb_per_h": round(float(fit.slope), 2),
                    "ci95_mb_per_h": [round(float(fit.slope - half), 2), round(float(fit.slope + half), 2)],
                    "r": round(float(fit.rvalue), 3) if math.isfinite(fit.rvalue) else None,
                    "mb_first": round(mb[0], 1), "mb_last": round(mb[-1], 1), "mb_max": round(max(mb), 1)}
    return out


def verdict(samples: list[dict[str, Any]], warmup_s: float, bound_mb_h: float) -> dict[str, Any]:
    """The leak report: slopes of RSS and of USS, the memory only that process holds (the
    verdict: RSS also counts shared file pages, weights and libraries, which the kernel reclaims
    and faults back in under memory pressure, moving RSS by tens of MB either way on a crowded
    machine; a leak is private memory), the processes over the bound, locked / pinned memory, the
    host pool."""
    fits, private = slopes(samples, warmup_s), slopes(samples, warmup_s, "uss_mib")
    over = sorted(k for k, f in private.items() if f.get("slope_mb_per_h", 0.0) > bound_mb_h)
    fitted = [k for k, f in private.items() if "slope_mb_per_h" in f]
    span = (samples[-1]["t_s"] - samples[0]["t_s"]) / 60 if samples else 0.0
    pool_used = [r["host"].get("superinfer_host_pool_blocks_used") for r in samples if r["host"]]
    return {"bound_mb_per_h": bound_mb_h, "warmup_s": warmup_s, "samples": len(samples),
            "span_min": round(span, 1), "slopes": fits, "uss_slopes": private,
            "anon_slopes": slopes(samples, warmup_s, "anon_mib"), "over_bound": over, "fitted": fitted,
            "locked_or_pinned_mib_max": max((p["locked_mib"] for r in samples for p in r["procs"].values()), default=0.0),
            "host_pool_blocks_used_max": max((v for v in pool_used if v is not None), default=None),
            "host_pool_blocks_total": next((r["host"].get("superinfer_host_pool_blocks_total") for r in reversed(samples)
                                            if r["host"].get("superinfer_host_pool_blocks_total") is not None), None)}


def plot(samples: list[dict[str, Any]], report: dict[str, Any], path: Path) -> None:
    """RSS of each process over time (warm-up shaded, fitted line dashed), host pool blocks below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(8, 8), sharex=True, height_ratios=[3, 2, 1])
    keys = sorted({k for r in samples for k in r["procs"]})
    for axis, field, fits in ((top, "uss_mib", report["uss_slopes"]), (mid, "rss_mib", report["slopes"])):
        for key in keys:  # growth against the first sample after the warm-up: levels differ by GBs
            rows = [r for r in samples if key in r["procs"]]
            x = [r["t_s"] / 60 for r in rows]
            y = [r["procs"][key][field] * 2**20 / 1e6 for r in rows]
            base = next((v for t, v in zip(x, y) if t * 60 >= report["warmup_s"]), y[0])
            line, = axis.plot(x, [v - base for v in y], marker=".", label=f"{key} ({base:.0f} MB)")
            if "slope_mb_per_h" in fits.get(key, {}):
                axis.annotate(f"{fits[key]['slope_mb_per_h']:+.1f} MB/h", (x[-1], y[-1] - base), fontsize=8,
                              color=line.get_color())
        axis.axvspan(0, report["warmup_s"] / 60, color="0.9")
        axis.axhline(0, color="0.5", lw=0.5)
        axis.set_ylabel(f"{field[:3].upper()} growth (MB)")
        axis.legend(fontsize=7, loc="lower left")
    top.set_title(f"soak: memory per server process since the warm-up (shaded); verdict on USS, "
                  f"bound {report['bound_mb_per_h']:g} MB/h", fontsize=9)
    used = [(r["t_s"] / 60, r["host"].get("superinfer_host_pool_blocks_used", 0.0)) for r in samples if r["host"]]
    if used:
        bottom.step(*zip(*used), where="post")
    bottom.set_ylabel("host pool blocks used")
    bottom.set_xlabel("minutes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(samples: list[dict[str, Any]], report: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "leak.json").write_text(json.dumps(report, indent=2))
    plot(samples, report, out_dir / "rss.png")


def add_args(ap: Any) -> None:
    ap.add_argument("--duration-s", type=float, default=0.0,
                    help="stop the arrivals after this many seconds (0: after --requests)")
    ap.add_argument("--leak-out", help="sample every server process's memory and write the leak report here")
    ap.add_argument("--leak-every-s", type=float, default=60.0)
    ap.add_argument("--leak-warmup-s", type=float, default=600.0, help="left out of the slope fit")
    ap.add_argument("--leak-bound-mb-h", type=float, default=DEFAULT_BOUND_MB_H,
                    help="fail if any process's RSS slope after the warm-up is above this")


def start(args: Any, server_ref: list[Any], shared: Any) -> LeakSampler | None:
    if not args.leak_out:
        return None
    sampler = LeakSampler(lambda: server_ref[0].proc.pid, lambda: shared.url, args.leak_every_s, Path(args.leak_out))
    sampler.start()
    return sampler


def finish(sampler: LeakSampler | None, args: Any) -> dict[str, Any] | None:
    """One last sample (the server idle: pools back at zero), the verdict, the files."""
    if sampler is None:
        return None
    sampler.stop_event.set()
    sampler.join(timeout=120)
    sampler.sample()
    report = verdict(sampler.samples, args.leak_warmup_s, args.leak_bound_mb_h)
    report["idle_at_end"] = sampler.samples[-1]["host"]
    write(sampler.samples, report, Path(args.leak_out))
    return report


def main(argv: list[str] | None = None) -> int:
    """Sidecar: sample a server already running (its launcher's pid) until it exits or
    --duration-s has passed, then write the same report (exit 1 over the bound)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--pid", type=int, help="the launcher's pid")
    ap.add_argument("--url", help="the server's URL, for /metrics")
    ap.add_argument("--samples", help="no sampling: the report from this samples.jsonl (e.g. a soak's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--every-s", type=float, default=60.0)
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--warmup-s", type=float, default=0.0)
    ap.add_argument("--bound-mb-h", type=float, default=DEFAULT_BOUND_MB_H)
    args = ap.parse_args(argv)
    if args.samples:
        samples = [json.loads(line) for line in Path(args.samples).read_text().splitlines() if line.strip()]
    else:
        sampler = LeakSampler(lambda: args.pid, lambda: args.url, args.every_s, Path(args.out))
        sampler.start()
        deadline = time.time() + args.duration_s
        while psutil.pid_exists(args.pid) and time.time() < deadline:
            time.sleep(1)
        sampler.stop_event.set()
        sampler.join()
        samples = sampler.samples
    report = verdict([r for r in samples if r["procs"]], args.warmup_s, args.bound_mb_h)
    write(samples, report, Path(args.out))
    print(json.dumps({k: report[k] for k in ("over_bound", "uss_slopes")}, indent=1))
    return 1 if report["over_bound"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
