"""The sweep's plot: step peak and step time against budget (PNG and SVG, matplotlib)."""

from __future__ import annotations

from pathlib import Path

from memprof.analysis.units import MB
from memprof.sweep.detect import worst_per_budget
from memprof.sweep.result import Sweep, run_estimate


def plot(sweep: Sweep, out: Path, stem: str = "sweep") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, constrained_layout=True)
    for v in sweep.variants:
        runs = [r for r in sweep.runs_of(v) if sweep.value(r) is not None]
        label = "stock" if v == "stock" else f"remat {v}"
        if sweep.mode == "predict":
            label += ", predicted"
        xs = [r.budget for r in runs]
        line = ax_mem.plot(xs, [(sweep.value(r) or 0) / MB for r in runs], marker="o", label=label)[0]
        est = [(r.budget, run_estimate(r, "memprof")) for r in runs]
        if sweep.mode == "measure" and any(e is not None for _b, e in est):
            ax_mem.plot([b for b, e in est if e is not None], [e / MB for _b, e in est if e is not None],
                        linestyle="--", color=line.get_color(), alpha=0.7, label=f"{label}: memprof estimate")
        time_key = "step_ms" if sweep.mode == "measure" else "compile_s"
        times = [(r.budget, getattr(r.measured, time_key) if r.measured else None) for r in runs]
        ax_time.plot([b for b, t in times if t is not None], [t for _b, t in times if t is not None], marker="o",
                     color=line.get_color(), label=label)
        flags = worst_per_budget(sweep.flags(v))
        if flags:
            ax_mem.scatter([f.low for f in flags], [f.low_peak / MB for f in flags], s=140, facecolors="none",
                           edgecolors="red", linewidths=1.5, zorder=3,
                           label=f"{label}: less budget, more memory" if v == sweep.variants[0] else None)
        failed = [r for r in sweep.runs_of(v) if not r.ok]
        for r in failed:
            ax_mem.axvline(r.budget, color="gray", linestyle=":", linewidth=1)
            ax_mem.annotate(r.status, (r.budget, 0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                            va="bottom", ha="right", color="gray")
    ax_mem.set_ylabel("step peak (MB, above the step's start)" if sweep.mode == "measure"
                      else "predicted step peak (MB, memprof's estimate)")
    ax_mem.set_ylim(bottom=0)
    ax_mem.grid(alpha=0.3)
    ax_mem.legend(fontsize=8)
    ax_time.set_ylabel("step time (ms, median)" if sweep.mode == "measure" else "compile time (s)")
    ax_time.set_xlabel("torch._functorch.config.activation_memory_budget")
    ax_time.set_ylim(bottom=0)
    ax_time.grid(alpha=0.3)
    title = " ".join(sweep.command)
    fig.suptitle(title if len(title) < 90 else title[:87] + "...", fontsize=9)
    paths = [out / f"{stem}.png", out / f"{stem}.svg"]
    for p in paths:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return paths
