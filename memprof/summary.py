"""The peak summary of a capture, as plain data (reporters format it)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from memprof._events import Kind, device_name
from memprof.attribution import CATEGORIES
from memprof.capture import Capture
from memprof.plans import Plan
from memprof.remat.report import RematReport
from memprof.timeline import freed_bytes, unfollowed_count


def fmt_bytes(n: int | None) -> str:
    """Human-readable size in decimal units (MB = 1e6 bytes, as the paper and nvidia-smi use)."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if v < 1000 or unit == "TB":
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.1f} {unit}"
        v /= 1000
    raise AssertionError("unreachable")


def summarize(cap: Capture, top: int = 8) -> dict[str, Any]:
    """Peak per device, the largest live allocations and scopes at each peak, steps, OOMs."""
    raw = cap.raw
    meta = cap.meta
    t0 = int(meta.get("t_start_ns", raw["t_ns"][0] if len(raw) else 0))
    t1 = int(meta.get("t_stop_ns", raw["t_ns"][-1] if len(raw) else t0))
    devices: list[dict[str, Any]] = []
    for dev in cap.devices:
        tl = cap.timeline(dev)
        live = cap.live_at_peak(dev)
        captured = sum(a.bytes for a in live)
        peak_t = int(tl.t_ns[tl.peak_pos]) if tl.peak_pos >= 0 else t0
        scopes = _top_scopes(((a.scope, a.bytes) for a in live), top)
        labels = cap.labels(dev)
        live_pos = np.searchsorted(tl.rows, [a.row for a in live[:top]])  # rows are sorted
        categories = [{"category": r.key, "bytes": r.bytes, "count": r.count, "share": r.share}
                      for r in cap.attribution("peak", "category", dev, lower_bound=True) if r.bytes]
        joins = [c for c in labels.calls]
        reasons: dict[str, int] = defaultdict(int)
        for c in joins:
            if c.level != "buffer":
                reasons[c.reason] += 1
        gc_pos = cap.gc_freed(dev)
        gc_made = ((cap.scope_name(int(raw["scope"][tl.rows[a]])) if a >= 0 else "allocated before the capture",
                    -int(tl.delta[p])) for p, a in zip(gc_pos.tolist(), tl.alloc_of[gc_pos].tolist(), strict=True))
        devices.append({
            "device": dev,
            # frees by Python's cyclic garbage collector (tensors in reference cycles): count, bytes
            "gc_freed": {"count": len(gc_pos), "bytes": freed_bytes(tl, gc_pos),
                         "by_scope": _top_scopes(gc_made, top)},  # by the op that allocated them
            "categories_at_peak": categories,
            "graph_calls": {"total": len(joins), "buffer_level": sum(c.level == "buffer" for c in joins),
                            "kernel_level": dict(reasons)},
            "peak_bytes": tl.peak,
            "peak_t_s": (peak_t - t0) / 1e9,
            "baseline_bytes": tl.baseline,
            "final_bytes": tl.final,
            "reserved_peak_bytes": tl.reserved_peak if tl.has_reserved else None,
            "live_at_peak": len(live),
            "allocated_before_capture_bytes": tl.peak - captured,
            "inferred_sizes": tl.inferred,
            "stack_at_peak": cap.scope_stack_at_peak(dev),
            "largest": [
                {"bytes": a.bytes, "requested": a.requested, "scope": a.scope,
                 "category": CATEGORIES[int(labels.category[p])],
                 "node": labels.names[int(labels.node[p])],
                 "age_ms": (peak_t - a.t_ns) / 1e6, "ptr": a.ptr}
                for a, p in zip(live[:top], live_pos.tolist(), strict=True)
            ],
            "scopes": scopes,
            "steps": [
                {"step": s.step, "peak_bytes": s.peak, "allocated_at_end": s.allocated_at_end,
                 "reserved_at_end": s.reserved_at_end, "complete": s.complete,
                 "gc_freed_bytes": freed_bytes(tl, gc_pos, s.start_row, s.end_row)}
                for s in cap.steps(dev)
            ],
        })
    oom_rows = np.flatnonzero(raw["kind"] == Kind.OOM)
    ooms = [
        {"device": device_name(int(raw["device_type"][r]), int(raw["device_index"][r])),
         "requested_bytes": int(raw["bytes"][r]),
         "free_bytes": int(raw["aux"][r]) if int(raw["aux"][r]) >= 0 else None,
         "t_s": (int(raw["t_ns"][r]) - t0) / 1e9, "scope": cap.scope_name(int(raw["scope"][r]))}
        for r in oom_rows
    ]
    return {
        "plans": [plan_summary(p) for p in cap.plans],
        "warnings": rng_warnings(cap),
        "path": meta.get("path"),
        "command": meta.get("command"),
        "budget": meta.get("budget"),
        "status": meta.get("status"),
        "exit_code": meta.get("exit_code"),
        "error": meta.get("error"),
        "events": len(raw),
        "duration_s": (t1 - t0) / 1e9,
        "dropped_events": cap.dropped,
        # False when a peak is only a lower bound (events dropped, capture stopped early); caveats say why
        "exact": cap.exact,
        "caveats": cap.caveats,
        "steps_run": meta.get("steps"),
        "max_events": meta.get("max_events"),
        "unfollowed_events": unfollowed_count(raw),
        "cuda_tracker": meta.get("cuda_tracker"),
        "devices": devices,
        "ooms": ooms,
        "notes": list(meta.get("notes", [])),
    }


def _top_scopes(items: Iterable[tuple[str, int]], top: int) -> list[dict[str, Any]]:
    """(scope, bytes) pairs summed by scope, largest first: [{"scope", "bytes", "count"}]."""
    by_scope: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for scope, nbytes in items:
        by_scope[scope or "(no scope)"][0] += nbytes
        by_scope[scope or "(no scope)"][1] += 1
    return [{"scope": k, "bytes": b, "count": c}
            for k, (b, c) in sorted(by_scope.items(), key=lambda kv: -kv[1][0])[:top]]


def plan_summary(plan: Plan) -> dict[str, Any]:
    fw = plan.forward.by_name
    return {
        "index": plan.index, "backend": plan.backend, "budget": plan.budget,
        "saved": len(plan.saved), "saved_bytes": sum(fw[n].bytes or 0 for n in plan.saved if n in fw),
        # saved values of symbolic size (dynamic shapes): not in saved_bytes, their size varies per call
        "saved_symbolic": sum(1 for n in plan.saved if n in fw and fw[n].bytes is None and fw[n].size_expr),
        "recomputed": len(plan.recomputed), "random_ops": len(plan.random_ops),
        "recomputed_random": list(plan.recomputed_random), "masks": list(plan.masks), "status": plan.status,
        "remat": remat_line(plan.remat) if plan.remat else None,
    }


def remat_line(r: dict[str, Any]) -> str:
    """One line on what memprof's remat pass did to a plan (from its stored report)."""
    return RematReport.from_json(r).summary()


def rng_warnings(cap: Capture) -> list[str]:
    """Plain statements of plans that recompute random ops in the backward (silently wrong gradients)."""
    out: list[str] = []
    for p in cap.plans:
        if p.recomputed_random:
            names = ", ".join(p.recomputed_random[:6]) + (f" and {len(p.recomputed_random) - 6} more"
                                                          if len(p.recomputed_random) > 6 else "")
            out.append(
                f"compiled graph {p.index} ({p.backend}, activation_memory_budget={p.budget:g}) recomputes "
                f"{len(p.recomputed_random)} random op(s) in the backward: {names}. The backward draws "
                "fresh random numbers, so dropout masks differ from the forward's and the gradients are "
                "silently wrong (pytorch/pytorch#190758). memprof's remat pass saves the dropout masks instead "
                "at any budget (memprof trace --remat light, or memprof.remat.enable(\"light\")); otherwise use "
                "budget 1.0 for models with dropout, or set torch._functorch.config.functionalize_rng_ops=True "
                "(CUDA)."
            )
    return out
