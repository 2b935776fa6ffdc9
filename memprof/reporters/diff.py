"""The text of `memprof diff`: what changed between two captures, table by table."""

from __future__ import annotations

from memprof.analysis.diff import CaptureDiff, DiffRow
from memprof.analysis.units import count, fmt_bytes
from memprof.errors import printable


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
