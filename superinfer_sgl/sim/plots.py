"""PNG plots of simulation sweeps (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


STYLE = {
    "sglang": ("tab:gray", "o", "-"), "sglang-priority": ("black", "x", ":"),
    "vllm-swap-waiting-first": ("tab:blue", "s", "-"), "vllm-swap-swapped-first": ("tab:cyan", "D", "--"),
    "lvf-naive": ("tab:orange", "v", "--"), "lvf-batched": ("gold", "^", "--"),
    "lvf-duplex": ("tab:red", "^", "-"), "lvf-duplex-direct": ("tab:purple", "P", "-."),
    "oracle": ("tab:green", "*", ":"),
}


def plot_attainment(results: list[dict], path: Path, profiles: Mapping[str, str]) -> None:
    """Rows: device profiles; columns: TTFT attainment, TBT attainment (90% of gaps), TPOT
    attainment (mean gap), P99 TTFT."""
    plt = _plt()
    fig, axes = plt.subplots(len(profiles), 4, figsize=(20, 4.2 * len(profiles)), squeeze=False)
    for row, (prof, label) in enumerate(profiles.items()):
        by_pol: dict[str, list[dict]] = {}
        for r in results:
            if r.get("sweep") == "rate" and r["job"]["profile"] == prof:
                by_pol.setdefault(r["policy"], []).append(r)
        for pol, pts in by_pol.items():
            pts.sort(key=lambda r: r["rate"])
            color, marker, ls = STYLE.get(pol, (None, "o", "-"))
            x = [r["rate"] for r in pts]
            kw = dict(color=color, marker=marker, linestyle=ls, label=pol)
            axes[row][0].plot(x, [100 * r["ttft_attainment"] for r in pts], **kw)
            axes[row][1].plot(x, [100 * r["tbt_attainment"] for r in pts], **kw)
            axes[row][2].plot(x, [100 * (r.get("tpot_attainment") or float("nan")) for r in pts], **kw)
            axes[row][3].plot(x, [r["ttft_p99_s"] or float("nan") for r in pts], **kw)
        for col, title in enumerate(("TTFT attainment (%), SLO 5 s", "TBT attainment (%), 90% of gaps <= 100 ms",
                                     "TPOT attainment (%), mean gap <= 100 ms", "P99 TTFT (s)")):
            ax = axes[row][col]
            ax.set_title(f"{label}: {title}", fontsize=10)
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            if col < 3:
                ax.set_ylim(-3, 103)
            else:
                ax.set_yscale("log")
        axes[row][0].legend(fontsize=7)
    fig.suptitle("Simulated Qwen2.5-32B-like, ShareGPT-like lengths, Poisson 120 s (python -m superinfer_sgl.sim paper)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_budget(results: list[dict], path: Path, profiles: Mapping[str, str]) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for prof, label in profiles.items():
        pts = sorted((r for r in results if r.get("sweep") == "budget" and r["job"]["profile"] == prof),
                     key=lambda r: r["budget_blocks"])
        if not pts:
            continue
        x = [r["budget_blocks"] for r in pts]
        line, = axes[0].plot(x, [r["ttft_p99_s"] or float("nan") for r in pts], marker="o", label=label)
        axes[1].plot(x, [100 * r["ttft_attainment"] for r in pts], marker="o", color=line.get_color(),
                     label=f"{label}: TTFT")
        axes[1].plot(x, [100 * r["tbt_attainment"] for r in pts], marker="x", linestyle="--",
                     color=line.get_color(), label=f"{label}: TBT (90% of gaps)")
    axes[0].set_title("LVF + DuplexKV at 20 req/s: P99 TTFT (s) vs rotation budget", fontsize=10)
    axes[1].set_title("LVF + DuplexKV at 20 req/s: attainment (%) vs rotation budget", fontsize=10)
    axes[1].set_ylim(-3, 103)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rotation budget B_xfer (blocks of 16 tokens per iteration)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_validation(rows: list[dict], path: Path) -> None:
    """Measured vs simulated attainment and P50 TTFT per (system, rate)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for system in sorted({r["system"] for r in rows}):
        pts = sorted((r for r in rows if r["system"] == system), key=lambda r: r["rate"])
        x = [r["rate"] for r in pts]
        for ax, key, scale in ((axes[0], "ttft_attainment", 100), (axes[1], "joint_attainment", 100),
                               (axes[2], "p50_ttft_s", 1)):
            line, = ax.plot(x, [scale * (r["measured"][key] or float("nan")) for r in pts], marker="o",
                            label=f"{system} measured")
            ax.plot(x, [scale * (r["simulated"][key] or float("nan")) for r in pts], marker="x",
                    linestyle="--", color=line.get_color(), label=f"{system} simulated")
    for ax, title in zip(axes, ("TTFT attainment (%)", "joint attainment (%)", "P50 TTFT (s)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
