"""The sweep's plot: step peak and step time against budget (PNG and SVG, matplotlib), and
`sweep.html`: the plot, the table and the findings in one page that opens offline."""

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
        if sweep.mode == "measure":  # each budget's median step and the spread of its steps (p10 to p90)
            spread = [(r.budget, m.step_ms, m.step_ms if m.step_ms_p10 is None else m.step_ms_p10,
                       m.step_ms if m.step_ms_p90 is None else m.step_ms_p90)
                      for r in runs if (m := r.measured) is not None and m.step_ms is not None]
            low = [t - lo for _b, t, lo, _hi in spread]
            high = [hi - t for _b, t, _lo, hi in spread]
            ax_time.errorbar([b for b, *_ in spread], [t for _b, t, *_ in spread], yerr=[low, high], fmt="o",
                             capsize=3, color=line.get_color(), label=label)
        else:
            times = [(r.budget, r.measured.compile_s if r.measured else None) for r in runs]
            ax_time.plot([b for b, t in times if t is not None], [t for _b, t in times if t is not None],
                         marker="o", color=line.get_color(), label=label)
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
    ax_mem.set_ylabel("step peak above resident bytes (MB)\n(not trace's whole-run peak)" if sweep.mode == "measure"
                      else "predicted step peak (MB, memprof's estimate)")
    ax_mem.set_ylim(bottom=0)
    ax_mem.grid(alpha=0.3)
    ax_mem.legend(fontsize=8)
    ax_time.set_ylabel("step time (ms: median, bars p10 to p90)" if sweep.mode == "measure" else "compile time (s)")
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


def html_page(sweep: Sweep, svg: str, table: str, findings: str) -> str:
    """One self-contained page: the plot (its SVG inline), the table and the findings (flags and
    their diagnoses), all as `memprof sweep` printed them."""
    from html import escape

    svg = svg[svg.find("<svg"):] if "<svg" in svg else ""
    title = escape(" ".join(sweep.command))
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>memprof sweep: {title}</title>"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "img-src data:\"><style>body{font:13px system-ui,sans-serif;margin:16px 24px;color:#1d2330}"
            "pre{font:12px ui-monospace,Menlo,monospace;background:#f6f7f9;border:1px solid #d9dde5;padding:10px;"
            "overflow:auto}svg{max-width:100%;height:auto}</style></head><body>"
            f"<h1 style=\"font-size:16px\">memprof sweep</h1><div><code>{title}</code></div>{svg}"
            f"<h2 style=\"font-size:14px\">Table</h2><pre>{escape(table)}</pre>"
            f"<h2 style=\"font-size:14px\">Findings</h2><pre>{escape(findings) or '(none)'}</pre></body></html>\n")

