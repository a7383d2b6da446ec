"""Helpers of scripts/gpu_ab.sh (the one self-timed GPU call of the A/B), kept in Python so they are tested.

    python -m superinfer_sgl.bench.gpu_ab timeline TSV JSON LIMIT MODE   # stage times -> timeline JSON
    python -m superinfer_sgl.bench.gpu_ab needs-fallback AB_JSON         # exit 0: rerun with CUDA graphs off

The script appends one line per stage to a TSV (name, start and end in seconds since the script
began, exit status, the stage's time limit, a note); `timeline` turns it into the JSON that comes back
from the device. `needs-fallback` says whether the A/B stopped because its first server did not
start (not up within --ready-timeout, or exited: with CUDA graphs on, capture is what a slow or
failed start most likely is, and the call has nothing better to spend its minutes on).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FIRST_SYSTEM_STOPPED = "stopped: the first system"
TIMED_OUT_RCS = (124, 137)  # timeout(1): the limit ran out; 137: killed after it


def read_stages(tsv: Path) -> list[dict[str, Any]]:
    stages = []
    for line in tsv.read_text().splitlines():
        if not line.strip():
            continue
        name, start, end, rc, limit, *note = line.split("\t")
        s, e, r = float(start), float(end), int(rc)
        stages.append({"stage": name, "start_s": s, "end_s": e, "seconds": round(e - s, 1), "rc": r,
                       "limit_s": float(limit), "timed_out": r in TIMED_OUT_RCS, "note": "\t".join(note)})
    return stages


def timeline(tsv: Path, limit_s: float, mode: str) -> dict[str, Any]:
    stages = read_stages(tsv) if tsv.is_file() else []
    total = max((s["end_s"] for s in stages), default=0.0)
    return {"mode": mode, "limit_s": limit_s, "total_s": total, "within_limit": total <= limit_s,
            "ok": bool(stages) and all(s["rc"] == 0 for s in stages), "stages": stages}


def needs_fallback(ab: dict[str, Any]) -> bool:
    """The sweep stopped because its first server did not start (too slow, or it exited)."""
    errors = ab.get("errors", {})
    return str(errors.get("sweep", "")).startswith(FIRST_SYSTEM_STOPPED)


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "timeline":
        doc = timeline(Path(argv[1]), float(argv[3]), argv[4])
        Path(argv[2]).write_text(json.dumps(doc, indent=1))
        for s in doc["stages"]:
            print(f"{s['stage']:<12} {s['start_s']:6.0f}s -> {s['end_s']:6.0f}s  {s['seconds']:6.1f}s "
                  f"(limit {s['limit_s']:.0f}s) rc={s['rc']} {s['note']}")
        print(f"total {doc['total_s']:.0f}s of {doc['limit_s']:.0f}s")
        return 0
    if len(argv) == 2 and argv[0] == "needs-fallback":
        path = Path(argv[1])
        return 0 if path.is_file() and needs_fallback(json.loads(path.read_text())) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
