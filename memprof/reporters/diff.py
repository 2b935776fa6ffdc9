"""The text and the page of `memprof diff`: what changed between two captures, table by table."""

from __future__ import annotations

from html import escape

from memprof.analysis.diff import CaptureDiff, DiffRow
from memprof.analysis.units import count, fmt_bytes
from memprof.errors import printable
from memprof.reporters.html import CATEGORY_COLORS


def _signed(n: int) -> str:
    return ("+" if n > 0 else "") + fmt_bytes(n) if n else "0 B"


def _table(by: str, rows: list[DiffRow], top: int) -> list[str]:
    changed = [r for r in rows if r.delta]
    lines = [f"by {by} (B - A; the rows sum to the difference):"]
    width = max((len(r.key) for r in changed[:top]), default=0)
    width = min(max(width, 12), 60)
    for r in changed[:top]:
        key = r.key if len(r.key) <= width else r.key[: width - 1] + "…"
        cat = f"  [{r.category}]" if by != "category" else ""
        lines.append(f"  {_signed(r.delta):>11}  {key:<{width}}  {fmt_bytes(r.a_bytes):>9} -> {fmt_bytes(r.b_bytes):<9}"
                     f"{cat}")
    rest = changed[top:]
    if rest:
        more = count(len(rest), "more row")
        lines.append(f"  {_signed(sum(r.delta for r in rest)):>11}  ({more} that changed; --top to see them)")
    if not changed:
        lines.append("  (nothing changed)")
    same = len(rows) - len(changed)
    if same:
        lines.append(f"  {'':>11}  ({count(same, 'row')} unchanged)")
    return lines


def format_diff(d: CaptureDiff, a_name: str, b_name: str, by: list[str], top: int) -> str:
    point = "the peak" if d.at == "peak" else f"the peak of step {d.at[5:]}"
    ratio = f", {d.ratio:.3f}x" if d.ratio else ""
    pct = f" ({d.delta / d.a_total * 100:+.2f}%{ratio})" if d.a_total else ""
    lines = [f"memprof diff: A {a_name}, B {b_name}: live bytes at {point} on {d.device}",
             f"  A {fmt_bytes(d.a_total)} ({d.a_total:,} B)  B {fmt_bytes(d.b_total)} ({d.b_total:,} B)  "
             f"B - A {_signed(d.delta)} ({d.delta:+,} B){pct}"]
    for name in by:
        lines.extend(_table(name, d.rows[name], top))
    return printable("\n".join(lines))


def _bar(d: CaptureDiff, rows: list[DiffRow], side: str, total: int) -> str:
    """One capture's bytes by category at the point as a stacked bar (widths relative to the larger total)."""
    top = max(d.a_total, d.b_total) or 1
    parts = []
    for r in sorted(rows, key=lambda r: r.key):
        b = r.a_bytes if side == "a" else r.b_bytes
        if b:
            parts.append(f'<span title="{escape(r.key)}: {b:,} B" style="width:{b / top * 100:.3f}%;'
                         f'background:{CATEGORY_COLORS.get(r.key, "#888")}"></span>')
    label = f"{side.upper()}: {fmt_bytes(total)} ({total:,} B)"
    return f'<div class="bar">{"".join(parts)}</div><div class="k">{label}</div>'


def diff_html(d: CaptureDiff, a_name: str, b_name: str, top: int = 200) -> str:
    """The diff as one self-contained page (no script; nothing fetched): the two captures' bytes by
    category at the point as bars, then every grouping as a table of the rows that changed (the
    largest `top`, the rest one row, so each table sums to the difference)."""
    cats = d.rows.get("category", [])
    pct = f" ({d.delta / d.a_total * 100:+.2f}%)" if d.a_total else ""
    point = "the peak" if d.at == "peak" else f"the peak of step {d.at[5:]}"
    body = [f"<h1>memprof diff</h1><p>A <code>{escape(a_name)}</code>, B <code>{escape(b_name)}</code>: "
            f"live bytes at {point} on {escape(d.device)}</p>",
            f'<p class="big" data-delta="{d.delta}">B − A {_signed(d.delta)} ({d.delta:+,} B){pct}</p>',
            _bar(d, cats, "a", d.a_total), _bar(d, cats, "b", d.b_total),
            '<div class="k">' + " ".join(f'<span style="color:{c}">&#9632;</span> {k}'
                                         for k, c in CATEGORY_COLORS.items() if any(r.key == k for r in cats))
            + "</div>"]
    biggest = max((abs(r.delta) for rs in d.rows.values() for r in rs), default=1) or 1
    for by, rows in d.rows.items():
        changed = [r for r in rows if r.delta]
        trs = []
        for r in changed[:top]:
            color = "#c62828" if r.delta > 0 else "#2e7d32"
            cat = f"<td>{escape(r.category)}</td>" if by != "category" else ""
            trs.append(f'<tr data-delta="{r.delta}"><td class="key">{escape(r.key)}</td>{cat}'
                       f'<td class="n">{r.a_bytes:,}</td><td class="n">{r.b_bytes:,}</td>'
                       f'<td class="n">{r.delta:+,}</td>'
                       f'<td><span class="d" style="width:{abs(r.delta) / biggest * 100:.2f}%;background:{color}">'
                       "</span></td></tr>")
        rest = changed[top:]
        if rest:
            span = 4 if by != "category" else 3
            more, rest_delta = count(len(rest), "more row"), sum(r.delta for r in rest)
            trs.append(f'<tr data-delta="{rest_delta}"><td colspan="{span}">({more} that changed)</td>'
                       f'<td class="n">{rest_delta:+,}</td><td></td></tr>')
        head = "<th>largest category</th>" if by != "category" else ""
        body.append(f"<h2>by {by}</h2><table><tr><th>{by}</th>{head}<th>A bytes</th><th>B bytes</th>"
                    f"<th>B − A</th><th></th></tr>{''.join(trs)}</table>")
    style = ("body{font:13px system-ui,sans-serif;margin:16px 24px;color:#1d2330}h1{font-size:16px}h2{font-size:14px;"
             "margin-top:18px}.big{font-size:18px;font-weight:600}.bar{display:flex;height:18px;width:100%;"
             "background:#f0f1f4;margin-top:8px}.bar span{display:block;height:100%}.k{color:#5b6475;font-size:12px}"
             "table{border-collapse:collapse;width:100%;font-size:12px}td,th{padding:2px 8px;border-bottom:1px solid "
             "#eceef2;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}td.key{font-family:"
             "ui-monospace,Menlo,monospace;max-width:520px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}"
             "span.d{display:inline-block;height:10px;min-width:1px}")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
            "<title>memprof diff</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")
