"""One compile plan in detail, for the HTML report's plans section: what the partitioner saved and
recomputed, by layer and by value, and what memprof's remat pass changed (its stored report)."""

from __future__ import annotations

import re
from typing import Any

from memprof.plans import FxNode, Plan, layer_of
from memprof.remat.report import RematReport

TOP_SAVED = 30  # the largest saved values listed by name; the rest are counted together


def _layer(node: FxNode | None) -> str:
    if node is not None and node.module_path:
        return layer_of(node.module_path)
    # a saved input (a parameter, the batch) is live anyway: saving it costs the step nothing more
    return "(graph input)" if node is not None and node.op == "placeholder" else "(no layer)"


def _value(node: FxNode) -> dict[str, Any]:
    return {"name": node.name, "target": node.target, "bytes": node.bytes, "layer": _layer(node),
            "shape": node.shape, "dtype": node.dtype, "random": node.random, "mask": node.mask}


def _layer_key(layer: str) -> tuple[Any, ...]:
    """Layers in their model order: "layers.2" before "layers.10", names without a number first."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", layer))


def plan_detail(plan: Plan, top: int = TOP_SAVED) -> dict[str, Any]:
    """The plan as the page shows it: saved values (the largest `top` by name, the rest summed) and
    saved and recomputed bytes by layer (symbolic sizes counted apart: they have no bytes), and the
    remat pass's report where it ran. Saved bytes sum to `PlanSummary.saved_bytes`."""
    fw = plan.forward.by_name
    saved = [fw[n] for n in plan.saved if n in fw]
    recomputed = [fw[n] for n in plan.recomputed if n in fw]
    by_layer: dict[str, list[int]] = {}  # layer -> [saved bytes, saved, recomputed bytes, recomputed]
    for nodes, at in ((saved, 0), (recomputed, 2)):
        for n in nodes:
            row = by_layer.setdefault(_layer(n), [0, 0, 0, 0])
            row[at] += n.bytes or 0
            row[at + 1] += 1
    ranked = sorted(saved, key=lambda n: -(n.bytes or 0))
    rest = ranked[top:]
    return {
        "index": plan.index,
        "saved": [_value(n) for n in ranked[:top]],
        "saved_rest": {"count": len(rest), "bytes": sum(n.bytes or 0 for n in rest)},
        "saved_bytes": sum(n.bytes or 0 for n in saved),
        "saved_symbolic": sum(1 for n in saved if n.bytes is None),
        "recomputed_bytes": sum(n.bytes or 0 for n in recomputed),
        "by_layer": [{"layer": k, "saved_bytes": v[0], "saved": v[1], "recomputed_bytes": v[2], "recomputed": v[3]}
                     for k, v in sorted(by_layer.items(), key=lambda kv: _layer_key(kv[0]))],
        "recomputed_random": list(plan.recomputed_random),
        "remat": _remat(plan, fw) if plan.remat else None,
    }


def _remat(plan: Plan, fw: dict[str, FxNode]) -> dict[str, Any]:
    """What the pass did, with the bytes and layer of each value it chose to save."""
    r = RematReport.from_json(plan.remat or {})

    def values(names: list[str]) -> list[dict[str, Any]]:
        return [_value(fw[n]) if n in fw else {"name": n, "bytes": None, "layer": "(no layer)"} for n in names]

    return {
        "mode": r.mode, "status": r.status, "summary": r.summary(), "start_budget": r.start_budget,
        "saved_added": values(r.saved_added), "random_saved": values(r.random_saved),
        "masks_saved": values(r.masks_saved), "stock_saved_bytes": r.stock_saved_bytes, "saved_bytes": r.saved_bytes,
        "estimate_before": r.estimate_before, "estimate_after": r.estimate_after,
        "usesite_edits": r.usesite_edits, "usesite_stopped": r.usesite_stopped,
        "seconds": r.seconds, "partition_seconds": r.partition_seconds, "notes": list(r.notes),
    }
