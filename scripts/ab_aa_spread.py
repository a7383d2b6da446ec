"""Run-to-run spread of stock SGLang against its identical twin (A/A) in A/B results.

Per run (one rate of one repeat): the twin's attainment minus stock's, in points. Prints, per
group of ab.json files, how many runs, their RMS and largest |difference|: the noise a single run
of the harness carries in that mode (e.g. interleaved vs --paired).

    python scripts/ab_aa_spread.py --label interleaved results/ab_cpu_interleaved_aa/ab.json.gz \
        --label paired results/ab_cpu_paired_aa/ab.json.gz
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from superinfer_sgl.bench import abfile

METRICS = ("joint_attainment", "ttft_attainment")


def aa_differences(doc: dict, metric: str) -> list[float]:
    res = doc["results"]
    twin = next((k for k in res if k.startswith("sglang#")), None)
    if twin is None:
        return []
    base = {(p.get("repeat", 0), p["rate"]): p for p in res["sglang"] if p.get("paired_with") in (None, twin)}
    return [100.0 * (p["summary"][metric] - base[key]["summary"][metric])
            for p in res[twin] if (key := (p.get("repeat", 0), p["rate"])) in base]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("items", nargs="+", help="--label NAME followed by ab.json files (or folders)")
    groups: dict[str, list[Path]] = {}
    label, argv = "runs", sys.argv[1:]
    i = 0
    while i < len(argv):
        if argv[i] == "--label":
            label, i = argv[i + 1], i + 2
            continue
        path = Path(argv[i])
        groups.setdefault(label, []).append(abfile.find(path))  # a folder's ab.json or ab.json.gz
        i += 1
    if not groups:
        ap.error("no ab.json given")
    for name, paths in groups.items():
        docs = [abfile.read_json(p) for p in paths]
        parts = []
        for metric in METRICS:
            diffs = [d for doc in docs for d in aa_differences(doc, metric)]
            if not diffs:
                parts.append(f"{metric}: no twin")
                continue
            rms = math.sqrt(sum(d * d for d in diffs) / len(diffs))
            parts.append(f"{metric}: {len(diffs)} runs, RMS {rms:.1f} pts, max |diff| {max(map(abs, diffs)):.1f} pts")
        print(f"{name} ({len(paths)} file(s)): " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
