"""The peak summary of a capture, as typed records (reporters format them)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from memprof.analysis.attribution import CATEGORIES, AttributionRow
from memprof.analysis.garbage import freed_bytes
from memprof.analysis.held_outputs import held_output_bytes
from memprof.analysis.labels import Labels
from memprof.analysis.oom import OomReport, oom_reports
from memprof.analysis.timeline import Timeline, unfollowed_count
from memprof.analysis.zero_grads import zero_grad_bytes
from memprof.capture import Capture
from memprof.plans import Plan
from memprof.remat.report import RematReport


@dataclass(frozen=True)
class ScopeBytes:
    scope: str  # the op or kernel that allocated
    bytes: int
    count: int


@dataclass(frozen=True)
class GcFreed:
    """Frees by Python's cyclic garbage collector (tensors in reference cycles)."""

    count: int
    bytes: int
    by_scope: list[ScopeBytes]  # by the op that allocated them


@dataclass(frozen=True)
class GraphCalls:
    total: int
    buffer_level: int  # joined to buffers and FX nodes
    kernel_level: dict[str, int]  # why the others fell back to kernel level -> how many
    # calls that made allocations their wrapper code does not show (`CallJoin.unseen`)
    unseen: int = 0


@dataclass(frozen=True)
class LiveRow:
    """One of the largest allocations live at a peak."""

    bytes: int
    requested: int  # -1 if unknown
    scope: str
    category: str
    node: str
    age_ms: float  # allocated this long before the peak
    ptr: int


@dataclass(frozen=True)
class StepRow:
    step: int
    peak_bytes: int
    allocated_at_end: int
    reserved_at_end: int | None
    complete: bool
    gc_freed_bytes: int
    start_s: float = 0.0  # from the capture's start
    duration_ms: float = 0.0
    allocated_at_start: int = 0  # live bytes just before the step's first event

    @property
    def rise_bytes(self) -> int:
        """How far the step's peak rose above what was live when it began."""
        return self.peak_bytes - self.allocated_at_start


@dataclass(frozen=True)
class DeviceSummary:
    device: str
    gc_freed: GcFreed
    categories_at_peak: list[AttributionRow]  # by category (key == category)
    graph_calls: GraphCalls
    peak_bytes: int
    peak_t_s: float
    baseline_bytes: int
    final_bytes: int
    reserved_peak_bytes: int | None
    live_at_peak: int
    allocated_before_capture_bytes: int
    inferred_sizes: int
    stack_at_peak: list[str]
    largest: list[LiveRow]
    scopes: list[ScopeBytes]
    steps: list[StepRow]
    zero_grads_at_peak: int = 0  # zeros autograd made for outputs no loss used (`memprof.analysis.zero_grads`)
    # outputs of compiled forwards the script held at the peak, unread by any backward, and their FX
    # nodes (`memprof.analysis.held_outputs`)
    held_outputs_at_peak: int = 0
    held_output_nodes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PlanSummary:
    index: int
    backend: str
    budget: float
    saved: int
    saved_bytes: int
    saved_symbolic: int  # saved values of symbolic size (dynamic shapes): not in saved_bytes
    recomputed: int
    random_ops: int
    recomputed_random: list[str]
    masks: list[str]
    status: str
    remat: str | None


@dataclass(frozen=True)
class StepFigures:
    """A compiled training step's peak above its resident bytes on the main device, as `memprof
    sweep` measures it (median over the steps after the compiling one) and as memprof's estimate
    from the compiled code predicts it: the figures the sweep's table prints as "peak" and "est"."""

    device: str
    steps: int  # steps found (the first, compiling one, is not measured when there are more)
    measured: int | None
    estimate: int | None
    unprobed: list[list[str]]  # fallback calls whose scratch the estimate could not measure, [op, why]
    phase: str = ""  # where the measured peak is: "forward", "backward", "" (outside compiled graphs)
    # the estimate of the requests alone where `estimate` counts the caching allocator's blocks
    # (replayed from its state when the measured step began), else None
    requested: int | None = None


def step_figures(cap: Capture) -> StepFigures | None:
    """The step figures of a capture with compile plans (None without plans, or if they cannot be
    computed: a figure the summary cannot vouch for is left out, never guessed)."""
    if not cap.plans or not cap.devices:
        return None
    from memprof.sweep.measure import measure

    try:
        m = measure(cap, attribution=False)
    except Exception:
        return None
    est = m.estimates.get("memprof")
    return StepFigures(m.device, m.steps, m.step_peak, int(est) if est is not None else None,
                       [list(u) for u in m.estimate_unprobed], m.peak_phase,
                       m.estimate_requested if m.estimate_blocks else None)


@dataclass(frozen=True)
class Summary:
    """What `memprof trace` and `memprof report` print (and `--json` writes, field for field)."""

    plans: list[PlanSummary]
    warnings: list[str]
    path: str | None
    command: str | None
    options_after_script: list[str]  # memprof's options that came after SCRIPT on its command line
    budget: Any
    status: str | None
    exit_code: int | None
    error: str | None
    events: int
    duration_s: float
    dropped_events: int
    exact: bool  # False when a peak is only a lower bound (events dropped, capture stopped early)
    caveats: list[str]  # why, when it is not
    steps_run: int | None
    max_events: int | None
    unfollowed_events: int
    cuda_tracker: str | None
    devices: list[DeviceSummary]
    ooms: list[OomReport]  # OOM forensics, one per OOM (memprof.analysis.oom)
    notes: list[str]
    step: StepFigures | None = None
    graph_breaks: list[str] = field(default_factory=list)  # where Dynamo split the compiled code, and why

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for d in out["devices"]:  # the JSON names each category once
            d["categories_at_peak"] = [{"category": r["key"], "bytes": r["bytes"], "count": r["count"],
                                        "share": r["share"]} for r in d["categories_at_peak"]]
        return out


def _device_summary(cap: Capture, dev: str, top: int, t0: int) -> DeviceSummary:
    raw = cap.raw
    tl = cap.timeline(dev)
    live = cap.live_at(dev, None, top)  # the largest; the rest counted from arrays (a peak can hold millions)
    every = tl.live_positions(tl.peak_pos) if tl.peak_pos >= 0 else np.zeros(0, np.int64)
    peak_t = int(tl.t_at(tl.peak_pos)) if tl.peak_pos >= 0 else t0
    labels = cap.labels(dev)
    live_pos = np.searchsorted(tl.rows, [a.row for a in live])  # rows are sorted
    reasons: dict[str, int] = defaultdict(int)
    for c in labels.calls:
        if c.level != "buffer":
            reasons[c.reason] += 1
    gc_pos = cap.gc_freed(dev)
    gc_made = ((cap.scope_name(int(raw["scope"][tl.rows[a]])) if a >= 0 else "allocated before the capture",
                -int(tl.delta_at(p))) for p, a in zip(gc_pos.tolist(), tl.alloc_of[gc_pos].tolist(), strict=True))
    return DeviceSummary(
        device=dev,
        gc_freed=GcFreed(len(gc_pos), freed_bytes(tl, gc_pos), _top_scopes(gc_made, top)),
        categories_at_peak=[r for r in cap.attribution("peak", "category", dev, lower_bound=True) if r.bytes],
        graph_calls=GraphCalls(len(labels.calls), sum(c.level == "buffer" for c in labels.calls), dict(reasons),
                               sum(c.unseen > 0 for c in labels.calls)),
        peak_bytes=tl.peak, peak_t_s=(peak_t - t0) / 1e9, baseline_bytes=tl.baseline, final_bytes=tl.final,
        reserved_peak_bytes=tl.reserved_peak if tl.has_reserved else None, live_at_peak=len(every),
        allocated_before_capture_bytes=tl.peak - int(tl.delta_at(every).sum()), inferred_sizes=tl.inferred,
        stack_at_peak=_shown_stack(cap.scope_stack_at_peak(dev)),
        largest=[LiveRow(a.bytes, a.requested, a.scope, CATEGORIES[int(labels.category[p])],
                         labels.names[int(labels.node[p])], (peak_t - a.t_ns) / 1e6, a.ptr)
                 for a, p in zip(live, live_pos.tolist(), strict=True)],
        scopes=_scopes_of(cap, raw["scope"][tl.rows[every]], tl.delta_at(every), top),
        steps=step_rows(cap, dev), zero_grads_at_peak=zero_grad_bytes(labels, tl, every),
        **_held(labels, tl, every),
    )


def _held(labels: Labels, tl: Timeline, every: np.ndarray) -> dict[str, Any]:
    held, nodes = held_output_bytes(labels, tl, every, int(tl.rows[tl.peak_pos])) if tl.peak_pos >= 0 else (0, [])
    return {"held_outputs_at_peak": held, "held_output_nodes": nodes[:3]}


def step_rows(cap: Capture, dev: str) -> list[StepRow]:
    """Each step on `dev`: its peak, what was live at its start and end, its time, what the garbage
    collector freed in it (`Capture.gc_freed`, found once per device)."""
    tl = cap.timeline(dev)
    gc_pos = cap.gc_freed(dev)
    t0 = cap.t0_ns
    return [StepRow(s.step, s.peak, s.allocated_at_end, s.reserved_at_end, s.complete,
                    freed_bytes(tl, gc_pos, s.start_row, s.end_row), (s.t_start_ns - t0) / 1e9,
                    (s.t_end_ns - s.t_start_ns) / 1e6, tl.allocated_before_row(s.start_row))
            for s in cap.steps(dev)]


def main_first(cap: Capture) -> list[str]:
    """The devices, the one that peaked (the main one) first: a GPU job's CPU side follows it."""
    return sorted(cap.devices, key=lambda d: d != cap.main_device)


def summarize(cap: Capture, top: int = 8) -> Summary:
    """Peak per device, the largest live allocations and scopes at each peak, steps, OOMs."""
    raw, meta, info = cap.raw, cap.meta, cap.info
    t0 = cap.t0_ns
    t1 = info.t_stop_ns or (int(raw["t_ns"][-1]) if len(raw) else t0)
    return Summary(
        plans=[plan_summary(p) for p in cap.plans], warnings=rng_warnings(cap), path=meta.get("path"),
        command=meta.get("command"), options_after_script=list(info.options_after_script), budget=meta.get("budget"),
        status=meta.get("status"),
        exit_code=meta.get("exit_code"), error=meta.get("error"), events=len(raw), duration_s=(t1 - t0) / 1e9,
        dropped_events=cap.dropped, exact=cap.exact, caveats=cap.caveats, steps_run=meta.get("steps"),
        max_events=meta.get("max_events"), unfollowed_events=unfollowed_count(raw),
        cuda_tracker=meta.get("cuda_tracker"), devices=[_device_summary(cap, d, top, t0) for d in main_first(cap)],
        ooms=oom_reports(cap, top), notes=list(meta.get("notes", [])), step=step_figures(cap),
        graph_breaks=list(info.graph_breaks),
    )


_STACK_SHOWN = (5, 30)  # outermost and innermost scopes shown of a deeper stack


def _shown_stack(stack: list[str]) -> list[str]:
    """A stack as the summary shows it: whole up to a depth real code reaches, else its ends."""
    outer, inner = _STACK_SHOWN
    if len(stack) <= outer + inner:
        return stack
    return [*stack[:outer], f"({len(stack) - outer - inner:,} scopes)", *stack[-inner:]]


def _scopes_of(cap: Capture, scopes: np.ndarray, sizes: np.ndarray, top: int) -> list[ScopeBytes]:
    """Live bytes by allocating scope (ids and sizes of the live allocations), the largest `top`."""
    if not len(scopes):
        return []
    ids, inverse = np.unique(scopes, return_inverse=True)
    totals = np.bincount(inverse, weights=sizes).astype(np.int64)
    counts = np.bincount(inverse)
    return _top_scopes(((cap.scope_name(int(ids[k])), int(totals[k]), int(counts[k])) for k in range(len(ids))), top)


def _top_scopes(items: Iterable[tuple[str, int] | tuple[str, int, int]], top: int) -> list[ScopeBytes]:
    """(scope, bytes) pairs summed by scope, largest first."""
    by_scope: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for scope, nbytes, *count in items:
        by_scope[scope or "(no scope)"][0] += nbytes
        by_scope[scope or "(no scope)"][1] += count[0] if count else 1
    return [ScopeBytes(k, b, c) for k, (b, c) in sorted(by_scope.items(), key=lambda kv: -kv[1][0])[:top]]


def plan_summary(plan: Plan) -> PlanSummary:
    fw = plan.forward.by_name
    return PlanSummary(
        index=plan.index, backend=plan.backend, budget=plan.budget, saved=len(plan.saved),
        saved_bytes=sum(fw[n].bytes or 0 for n in plan.saved if n in fw),
        saved_symbolic=sum(1 for n in plan.saved if n in fw and fw[n].bytes is None and fw[n].size_expr),
        recomputed=len(plan.recomputed), random_ops=len(plan.random_ops),
        recomputed_random=list(plan.recomputed_random), masks=list(plan.masks), status=plan.status,
        remat=remat_line(plan.remat) if plan.remat else None,
    )


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
                "silently wrong (pytorch/pytorch#190758). memprof's remat pass saves the random values instead "
                "(Inductor's seeds: a few bytes; with fallback_random, the masks) at any budget "
                "(memprof trace --remat light, or memprof.remat.enable(\"light\")); otherwise use "
                "budget 1.0 for models with dropout, or set torch._functorch.config.functionalize_rng_ops=True "
                "(CUDA)."
            )
    return out
