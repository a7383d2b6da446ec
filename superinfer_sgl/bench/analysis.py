"""A finished sweep's figures, from its ab.json alone: the comparisons (runs with repeats or pairs)
or the targets and noise band (one run), table.md and the plot. The sweep's end and
`ab_bench.py --report DIR` both go through `analyse`, so a re-report redoes all of it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import abfile
from .report import check_targets, comparisons, noise_band, plot, pooled_results, render_markdown
from .servers import noise_twin_name


def record_roles(cfg: dict[str, Any], ours: Sequence[str], compared: Sequence[tuple[str, str]]) -> None:
    """Which systems are ours and which pairs are compared, kept in the config for re-reports."""
    cfg["ours"] = list(ours)
    cfg["compared"] = [[a, b] for a, b in compared]


def multi_run(cfg: dict[str, Any]) -> bool:
    """Several runs per system and rate (repeats, or ours beside each baseline): pooled reports."""
    return bool(cfg.get("pairs")) or cfg.get("repeats", 1) > 1


def _ours(cfg: dict[str, Any], results: dict[str, Any]) -> list[str]:
    names = cfg.get("ours")
    if names is None:  # a run from before the roles were recorded: ours are named superinfer*
        names = [n for n in results if n.startswith("superinfer")]
    return [n for n in names if n in results]


def _compared(cfg: dict[str, Any], results: dict[str, Any]) -> list[tuple[str, str]]:
    pairs = cfg.get("compared")
    if pairs is None:  # recorded before the roles were: the paired ones, else stock and its twins vs ours
        pairs = cfg.get("pairs") or []
        if not pairs:
            pairs = [(n, "superinfer") for n in ("sglang", "sglang-priority") if n in results and "superinfer" in results]
            pairs += [("sglang", n) for n in results if n.startswith("sglang#")]
    return [(a, b) for a, b in pairs]


def analyse(doc: dict[str, Any], out_dir: Path) -> None:
    """Recompute every derived figure of `doc` in place and write table.md and attainment.png."""
    results = {k: v for k, v in doc["results"].items() if v}
    cfg = doc["config"]
    for key in ("comparisons", "targets", "targets_by_system", "noise_band"):
        doc.pop(key, None)
    multi = multi_run(cfg)
    if multi:
        doc["comparisons"] = comparisons(results, _compared(cfg, results))
    else:
        twin = noise_twin_name("sglang")
        if "sglang" in results and twin in results:
            doc["noise_band"] = noise_band(results, "sglang", twin)
        ours = _ours(cfg, results)
        if "sglang" in results and ours:
            doc["targets_by_system"] = {name: check_targets(results, "sglang", name) for name in ours}
            doc["targets"] = doc["targets_by_system"][ours[0]]
    if results:
        title = f"{cfg.get('profile')} / {cfg.get('workload')}: {cfg.get('machine', {}).get('cpu', '')}"
        if multi:
            title += f" (pooled over {cfg.get('repeats', 1)} repeat(s){', paired' if cfg.get('pairs') else ''})"
        plot(pooled_results(results) if multi else results, out_dir / "attainment.png", title)
    (out_dir / "table.md").write_text(render_markdown(doc))


def rereport(out_dir: Path) -> dict[str, Any]:
    """`--report DIR`: the statistics or the report changed; no server is started."""
    path = abfile.find(out_dir)  # ab.json, or ab.json.gz: written back under the same name
    doc = abfile.read_json(path)
    analyse(doc, out_dir)
    abfile.write_json(path, doc)
    return doc
