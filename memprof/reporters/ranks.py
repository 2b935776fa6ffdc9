"""The merged report of a distributed run's rank files (`memprof report RUN`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import IO, Any

from memprof.analysis.ranks import RankSet, rank_set
from memprof.analysis.units import fmt_bytes
from memprof.outputs import json_text
from memprof.reporters.registry import Run


def write_ranks_text(run: Run, _options: Any, out: IO[str]) -> None:
    out.write(render_ranks(run.name, rank_set(run.captures, run.world_size), False) + "\n")


def write_ranks_json(run: Run, _options: Any, out: IO[str]) -> None:
    out.write(render_ranks(run.name, rank_set(run.captures, run.world_size), True) + "\n")


def render_ranks(name: str, ranks: RankSet, as_json: bool) -> str:
    top, lowest = ranks.highest, ranks.lowest
    if as_json:
        return json_text({"run": name, "world_size": ranks.world_size, "backend": ranks.backend,
                           "highest_rank": top.rank, "spread_bytes": ranks.spread,
                           "ranks": [asdict(r) for r in ranks.rows]}, indent=1)
    lines = [f"memprof: {name}: {ranks.world_size} ranks" + (f" ({ranks.backend})" if ranks.backend else ""),
             f"  {'rank':>4}  {'device':<8} {'peak':>12} {'exact bytes':>15} {'at':>9} {'step':>5} "
             f"{'phase':<9}  largest at the peak"]
    for r in ranks.rows:
        cats = ", ".join(f"{k} {fmt_bytes(b)}" for k, b in r.top)
        flag = "" if r.exact else " (lower bound)"
        ended = "" if r.status in (None, "completed", "exit") else f"  [{r.status}]"
        lines.append(f"  {r.rank:>4}  {r.device:<8} {fmt_bytes(r.peak):>12} {r.peak:>15,} {r.at_s:>8.3f}s "
                     f"{r.step if r.step is not None else '-':>5} {r.phase or '-':<9}  {cats}{flag}{ended}")
    share = ranks.spread / top.peak if top.peak else 0.0
    if ranks.spread:
        lines.append(f"  highest: rank {top.rank} ({fmt_bytes(top.peak)}); spread {fmt_bytes(ranks.spread)} "
                     f"({share:.1%}) over rank {lowest.rank}")
    else:
        lines.append(f"  every rank peaks at {fmt_bytes(top.peak)}")
    for r in ranks.rows:
        if r.distributed:
            lines.append(f"  rank {r.rank} at its peak: " + ", ".join(f"{k} {fmt_bytes(b)}" for k, b in r.distributed))
    for r in ranks.rows:
        if r.status not in (None, "completed", "exit"):
            why = f": {r.error[:160]}" if r.error else ""
            if r.status == "cut short":
                why = " (killed or crashed before it saved: recovered from its spill, its figures are lower bounds)"
            lines.append(f"  rank {r.rank} ended: {r.status}{why}")
    lines.append(f"  one rank in full: memprof report {name} --rank R")
    return "\n".join(lines)
