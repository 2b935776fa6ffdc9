"""`memprof export --format html`: one self-contained page that opens offline (`memprof.analysis.view`
says what it draws). Its code is memprof's own (`assets/report.js`, `assets/report.css`, inlined);
the data is compact JSON in a `<script type="application/json">` element, every `</` escaped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from html import escape
from importlib import resources
from typing import IO, Any

from memprof.analysis.labels import CATEGORIES
from memprof.analysis.oom import format_oom, oom_reports
from memprof.analysis.plan_view import plan_detail
from memprof.analysis.summary import main_first, summarize
from memprof.analysis.view import MAX_ITEMS, MAX_POINTS, device_view, step_bands
from memprof.capture import Capture
from memprof.errors import MemprofError, printable
from memprof.reporters.registry import Reporter, Run, register

# a colour per category (Tableau 10 and its lighter companions), for the page's script and the diff page
CATEGORY_COLORS = {
    "parameter": "#4e79a7", "gradient": "#f28e2b", "optimizer_state": "#76b7b2", "input": "#bab0ac",
    "saved_activation": "#e15759", "recomputed": "#ff9da7", "rng_mask": "#b07aa1", "temporary": "#59a14f",
    "workspace": "#edc948", "unattributed": "#9c9c9c", "unsharded_parameter": "#86bcb6",
    "unsharded_gradient": "#fabfd2", "all_gather": "#d4a6c8", "reduce_scatter": "#8cd17d", "ddp_bucket": "#b6992d",
}

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>memprof: {title}</title><style>{css}</style></head>
<body>
<header><h1>memprof report</h1><div class="cmd" id="cmd"></div></header>
<main>
<section><div class="figures" id="figures"></div><div id="caveats"></div></section>
<section><h2>Timeline by category</h2><div class="tabs" id="tabs"></div>
<div class="legend" id="legend"></div>
<div class="hint">x axis: <label><input type="radio" name="xaxis" value="pos" checked> allocation events</label>
<label><input type="radio" name="xaxis" value="t"> time</label></div>
<div id="plot"><canvas id="timeline"></canvas><div id="tip"></div></div>
<div class="hint">Click a point for what is live there; wheel to zoom, drag to pan, double-click to reset.
<button id="to-peak">back to the peak</button></div></section>
<section id="lanes-section" hidden><h2>Ranks side by side</h2><div class="hint" id="lanes-hint"></div>
<div id="lanes"></div></section>
<section id="live"><h2 id="at-label"></h2><div class="hint" id="live-count"></div><div class="scroll"><table>
<thead><tr><th data-key="node">FX node</th><th data-key="layer">layer</th><th data-key="kernel">kernel</th>
<th data-key="category">category</th><th class="num sorted" data-key="bytes">bytes</th>
<th class="num" data-key="age">age</th></tr></thead><tbody id="live-body"></tbody>
<tfoot><tr><td colspan="4">total live</td><td class="num" id="live-total"></td><td></td></tr></tfoot>
</table></div></section>
<div class="cols">
<section><h2>Bytes at the peak by layer and category</h2><div class="scroll"><table><thead id="lc-head"></thead>
<tbody id="lc-body"></tbody></table></div></section>
<section><h2>Compile plans</h2><div id="plans"></div>{oom}</section>
</div>
</main>
<script type="application/json" id="memprof-data">{data}</script>
<script>{js}</script>
</body></html>
"""


def _asset(name: str) -> str:
    return resources.files("memprof.reporters").joinpath("assets", name).read_text(encoding="utf-8")


def page_data(cap: Capture, max_points: int = MAX_POINTS, max_items: int = MAX_ITEMS) -> dict[str, Any]:
    """The page's data: `memprof report --json`'s summary (every figure the page prints comes from
    it or from the timeline it was computed from) and each device's view, the main device first."""
    raw = cap.raw
    t0 = cap.t0_ns
    views = []
    for d in main_first(cap):
        tl = cap.timeline(d)
        views.append(device_view(tl, cap.labels(d), raw, t0, step_bands(tl, t0, cap.steps(d)), max_points, max_items))
    return {"summary": summarize(cap).to_json(), "devices": views, "category_names": list(CATEGORIES),
            "plan_details": [plan_detail(p) for p in cap.plans],
            "category_colors": CATEGORY_COLORS,
            "generator": f"memprof {cap.meta.get('memprof_version', '')}"}


@dataclass(frozen=True)
class HtmlOptions:
    max_points: int = MAX_POINTS  # timeline points a device (each bucket's lowest and highest)
    max_items: int = MAX_ITEMS  # allocations in the live table


def _write_html(cap: Capture, o: HtmlOptions, out: IO[str]) -> None:
    if not any(len(cap.timeline(d).rows) for d in cap.devices):  # (a garbage collection's markers are events)
        raise MemprofError("the capture recorded no allocation on any device: nothing to draw")
    title = str(cap.meta.get("command") or "capture")
    out.write(_page(page_data(cap, o.max_points, o.max_items), title, [("", cap)]))


def _write_run(run: Run, o: HtmlOptions, out: IO[str]) -> None:
    """A distributed run's page: each rank's devices as tabs of their own ("rank R: cuda:0") with
    their peaks side by side; the command, plans and warnings are rank 0's (every rank ran the
    same script)."""
    ranks = {r: c for r, c in sorted(run.captures.items()) if len(c.raw)}
    if not ranks:
        raise MemprofError(f"{run.name}: no rank recorded any event: nothing to draw")
    pages = {r: page_data(c, o.max_points, o.max_items) for r, c in ranks.items()}
    data = dict(pages[min(pages)])
    summary = dict(data["summary"])
    summary["command"] = f"{run.name}: {len(ranks)} of {run.world_size} ranks · {summary.get('command') or ''}"
    summary["devices"] = [{**d, "device": f"rank {r}: {d['device']}"} for r, p in pages.items()
                          for d in p["summary"]["devices"]]
    summary["events"] = sum(int(p["summary"]["events"]) for p in pages.values())
    summary["exact"] = all(p["summary"]["exact"] for p in pages.values())
    summary["caveats"] = [f"rank {r}: {c}" for r, p in pages.items() for c in p["summary"]["caveats"]]
    data["summary"] = summary
    # one host's ranks share its monotonic clock: their lanes line up in time (when they ran together)
    hosts = {c.meta.get("hostname") for c in ranks.values()}
    together = max(c.t0_ns for c in ranks.values()) < min(int(c.raw["t_ns"].max()) for c in ranks.values())
    aligned = len(hosts) == 1 and None not in hosts and together
    why = "" if aligned else "the ranks ran on different hosts" if len(hosts) > 1 else "the ranks did not run together"
    start = min(c.t0_ns for c in ranks.values())
    data["devices"] = [{**v, "device": f"rank {r}: {v['device']}",
                        "offset_s": (ranks[r].t0_ns - start) / 1e9 if aligned else 0.0}
                       for r, p in pages.items() for v in p["devices"]]
    data["lanes"] = {"aligned": aligned, "why_not": why}
    out.write(_page(data, run.name, [(f"rank {r}: ", c) for r, c in ranks.items()]))


def _page(data: dict[str, Any], title: str, ooms_of: list[tuple[str, Capture]]) -> str:
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    ooms = [(who, "\n".join(format_oom(r))) for who, cap in ooms_of for r in oom_reports(cap)]
    oom = "".join(f'<h2>{escape(who)}Out of memory</h2><pre class="caveat">{escape(printable(t))}</pre>'
                  for who, t in ooms)
    return _PAGE.format(title=escape(title), css=_asset("report.css"), js=_asset("report.js"),
                        data=text.replace("</", "<\\/"), oom=oom)


register(Reporter("html", "export", ".html", "self-contained HTML report (timeline, live table, layers x categories)",
                  HtmlOptions, _write_html, _write_run))
