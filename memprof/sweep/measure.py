"""What one budget's capture says: step peaks, step time, the plan's selection and lifetimes.

Analysis of a loaded `Capture` (numpy; nothing printed; torch only where memprof's estimate
probes a fallback kernel's scratch, `memprof.sweep.probe`). The step peak follows the paper's
reference method (docs/sweep.md): the most memory allocated during a step above what was allocated
when it began, median over the steps after the first (compiling) one; "when it began" is the
lowest level reached in the step before that high point (`window_rise`), so a loop that frees its
gradients at `zero_grad(set_to_none=True)` is measured above its resident bytes, as the paper's
loop (gradients kept) is. Steps are the capture's step markers (optimizer steps or
`memprof.step()`); a script with neither is split at each call of its first compiled forward graph.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from memprof._events import Kind
from memprof.analysis.caching_allocator import CachingAllocatorModel, OptimizerStep, model_at
from memprof.analysis.garbage import freed_bytes
from memprof.analysis.held_outputs import carried_saved_bytes
from memprof.analysis.timeline import Timeline, rise_start, window_rise
from memprof.analysis.units import round_up_array
from memprof.capture import Capture
from memprof.errors import one_line
from memprof.plans import CompiledGraph, FxNode, Plan
from memprof.sweep.block_peak import FirstCalls
from memprof.sweep.step_estimate import CaptureEstimate

KNAPSACK = "knapsack evaluator"  # the in-tree KnapsackEvaluator's peak, in normalized units (ranking only)

# op classes the diagnosis sums bytes by, in display order
OP_CLASSES = ("attention", "attention proj", "mlp", "norm", "mask", "random", "embedding", "residual/other")


def op_class(node: FxNode) -> str:
    """The class of a forward value, from its op and module path (`layers.3.mlp.down_proj`)."""
    target = node.target.lower()
    path = node.module_path.lower()
    leaf = path.rsplit(".", 1)[-1]
    if node.random:
        return "random"
    if node.mask or node.dtype == "torch.bool" or node.dtype == "bool":
        return "mask"
    if any(k in target for k in ("scaled_dot_product", "_efficient_attention", "_flash_attention", "_cudnn_attention")):
        return "attention"
    if "norm" in leaf or "layer_norm" in target or "rsqrt" in target or "var_mean" in target:
        return "norm"
    if "mlp" in path or "intermediate" in path or leaf in ("fc1", "fc2", "ffn", "feed_forward") or (
            ".output" in path and "attention" not in path):
        return "mlp"
    if any(k in path for k in ("attn", "attention")):
        return "attention proj"
    if "embed" in path or "embedding" in target:
        return "embedding"
    return "residual/other"


def bytes_by_class(nodes: Iterable[FxNode]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for n in nodes:
        if n.bytes:
            out[op_class(n)] += int(n.bytes)
    return {c: out[c] for c in OP_CLASSES if out.get(c)}


@dataclass
class PlanFacts:
    """The partitioner's choice for one forward/backward pair, summed by op class."""

    saved_bytes: int
    recomputed_bytes: int
    saved: dict[str, int]  # op class -> bytes saved
    recomputed: dict[str, int]  # op class -> bytes the backward recomputes
    hold: float | None  # bytes-weighted share of the backward a recomputed value is held (0..1)
    held_long_bytes: int  # recomputed bytes held over more than half of the backward
    recomputed_random: list[str]  # random forward nodes the backward runs again


def plan_facts(plan: Plan) -> PlanFacts:
    fw = plan.forward.by_name
    saved_nodes = [fw[n] for n in plan.saved if n in fw and fw[n].op != "placeholder"]
    recomputed_nodes = [fw[n] for n in plan.recomputed if n in fw]
    n_bw = max(1, len(plan.backward.nodes))
    weight = 0
    total = 0.0
    held_long = 0
    for site in plan.recompute_sites:
        b = int(site.bytes or 0)
        share = max(0, site.last_use - site.defined_at) / n_bw
        weight += b
        total += b * share
        if share > 0.5:
            held_long += b
    return PlanFacts(
        saved_bytes=sum(int(n.bytes or 0) for n in saved_nodes),
        recomputed_bytes=sum(int(n.bytes or 0) for n in recomputed_nodes),
        saved=bytes_by_class(saved_nodes),
        recomputed=bytes_by_class(recomputed_nodes),
        hold=total / weight if weight else None,
        held_long_bytes=held_long,
        recomputed_random=list(plan.recomputed_random),
    )


def merge_facts(facts: Sequence[PlanFacts]) -> PlanFacts | None:
    if not facts:
        return None

    def add(dicts: Iterable[dict[str, int]]) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for d in dicts:
            for k, v in d.items():
                out[k] += v
        return {c: out[c] for c in OP_CLASSES if out.get(c)}

    w = sum(f.recomputed_bytes for f in facts if f.hold is not None)
    hold = (sum(f.hold * f.recomputed_bytes for f in facts if f.hold is not None) / w) if w else None
    return PlanFacts(sum(f.saved_bytes for f in facts), sum(f.recomputed_bytes for f in facts),
                     add(f.saved for f in facts), add(f.recomputed for f in facts), hold,
                     sum(f.held_long_bytes for f in facts), [r for f in facts for r in f.recomputed_random])


@dataclass
class Measured:
    """One budget, reduced to what the sweep compares: measured from its capture, or (`memprof sweep
    --predict`) predicted at compile time, with no step run (`at_peak_source` "estimate")."""

    device: str
    peak: int | None  # the device's peak over the whole capture (bytes); None when predicted
    step_peak: int | None  # median over measured steps of the step's rise above its resident bytes (`window_rise`)
    step_peaks: list[int]
    step_ms: float | None  # median wall time of the measured steps
    steps: int  # steps found (the first, compiling one, is not measured when there are more)
    step_source: str  # "markers", "forward graph calls" or "whole capture"
    compiled: bool  # the script compiled at least one graph with a backward (a plan was recorded)
    plans: int
    facts: PlanFacts | None
    at_peak: dict[str, int] = field(default_factory=dict)  # category -> bytes live at the measured step's peak
    peak_phase: str = ""  # "forward", "backward", "optimizer step" (a CPU estimate), or "" (unknown)
    buffer_level: bool = False  # Inductor wrapper code joined allocations to FX nodes (recomputed values told apart)
    estimates: dict[str, float | None] = field(default_factory=dict)  # estimator -> predicted step peak (bytes)
    notes: list[str] = field(default_factory=list)
    # memprof's estimate, explained: where its peak is and what is live there by category (the
    # step's own allocations); in a --predict sweep these are at_peak and peak_phase themselves
    estimate_at_peak: dict[str, int] = field(default_factory=dict)
    estimate_peak_phase: str = ""
    # fallback calls whose scratch memprof's estimate could not measure, [op, why]: it leaves it out
    estimate_unprobed: list[list[str]] = field(default_factory=list)
    # memprof's estimate of the requests alone, and whether its figure ("memprof") counts the caching
    # allocator's blocks instead, replayed from the allocator's state when the measured step began
    estimate_requested: int | None = None
    estimate_blocks: bool = False
    # the most Python's cyclic garbage collector freed in one measured step (tensors in reference
    # cycles: the peak depends on when collections run)
    gc_freed: int = 0
    # bytes the CUDA caching allocator handed out above the requests (rounded to its 512-byte
    # granules) among the step's allocations live at the median step's peak: large blocks it did
    # not split because the rest would have been under 1 MiB. An estimate of requested bytes never
    # sees them (0 on the CPU, whose blocks are the requests)
    block_slack: int = 0
    at_peak_source: str = "capture"  # what at_peak and peak_phase describe: "capture" or "estimate"
    # compiled-graph calls that made allocations their wrapper code does not show (`CallJoin.unseen`):
    # what memprof's estimate cannot count
    unseen_calls: int = 0
    # predicted: compile seconds this budget alone would take, its own partition and compile, and
    # the part its process shared with the other budgets (script, Dynamo, joint graph)
    compile_s: float | None = None
    own_compile_s: float | None = None
    shared_s: float | None = None
    # the bytes a step starts from: measured, the level the median step rose from (its peak less
    # `step_peak`); predicted, what was allocated when the first compiled graph ran plus what is
    # made before the next step (the optimizers' state, the cuBLAS workspaces on CUDA).
    # `resident + step_peak` is the process's peak in a step after the first
    resident: int | None = None
    # predicted on CUDA: the caching allocator's reserved bytes by the end of a step after the first,
    # from its model (the segments the first step and the next made, and the cuBLAS workspaces'); low
    # where a real run allocates what the model never sees (Inductor's autotuning, eager code outside
    # the compiled graphs), whose segments stay reserved
    reserved: int | None = None
    # predicted: the bytes of the live modules' parameters on the device (what parameter-count
    # estimators start from: `memprof fit` prints theirs beside its own)
    parameter_bytes: int | None = None
    # the spread of the measured steps' wall times (10th and 90th percentiles): the plot draws it
    step_ms_p10: float | None = None
    step_ms_p90: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> Measured:
        known = {k: v for k, v in d.items() if k in _MEASURED_FIELDS}
        facts = known.get("facts")
        known["facts"] = PlanFacts(**facts) if isinstance(facts, dict) else None
        return Measured(**known)


@dataclass
class ChildResult:
    """What one sweep child process reports for one budget (the JSON file it writes)."""

    budget: float
    remat: str
    status: str  # completed | exit | exception | oom | interrupted | stopped | memprof-error
    exit_code: int | None
    error: str | None
    measured: Measured | None
    measure_error: str | None = None  # why the child could not measure its capture (the parent then does)
    details: dict[str, Any] = field(default_factory=dict)  # predict: the group, kernels compiled, ...

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> ChildResult:
        m = d.get("measured")
        return ChildResult(float(d["budget"]), str(d.get("remat", "off")), str(d["status"]), d.get("exit_code"),
                           d.get("error"), Measured.from_json(m) if isinstance(m, dict) else None,
                           d.get("measure_error"), dict(d.get("details") or {}))


def _windows(cap: Capture, device: str) -> tuple[list[tuple[int, int, int, int]], str]:
    """(start row, end row, t start, t end) per step."""
    raw = cap.raw
    forward = {g.scope_name for g in cap.graphs if g.role in ("forward", "inference")}
    begins = np.flatnonzero(raw["kind"] == Kind.SCOPE_BEGIN)
    names = {int(s): cap.scope_name(int(s)) for s in np.unique(raw["scope"][begins]).tolist()}
    # each call of a compiled region opens these scopes: Inductor's forward graph, Dynamo's frame
    # ("Torch-Compiled Region: 0/0", any backend), AOTAutograd's forward ("CompiledFunction")
    opened: tuple[tuple[str, Callable[[str], bool]], ...] = (
        ("forward graph calls", lambda n: n in forward),
        ("compiled-region calls", lambda n: n.startswith("Torch-Compiled Region:")),
        ("compiled-function calls", lambda n: n == "CompiledFunction"))
    calls = [sid for sid, n in names.items() if any(match(n) for _, match in opened)]
    steps = cap.steps(device, tail=True)  # the events after the last marker: a step whose marker never came,
    if steps and not steps[-1].complete and calls:  # or the script's wrap-up, which calls no compiled region
        tail = begins[(begins >= steps[-1].start_row) & (begins < steps[-1].end_row)]
        if not np.isin(raw["scope"][tail], calls).any():
            steps = steps[:-1]  # (its rise of about nothing would pull the median down: 0 of two steps)
    if len(steps) >= 2:
        return [(s.start_row, s.end_row, s.t_start_ns, s.t_end_ns) for s in steps], "markers"
    t_stop = cap.info.t_stop_ns or (int(raw["t_ns"][-1]) if len(raw) else 0)
    for what, match in opened:
        first: int | None = None
        rows: list[int] = []
        for r, sid in zip(begins.tolist(), raw["scope"][begins].tolist(), strict=True):
            if match(names[int(sid)]):
                if first is None:
                    first = int(sid)
                if int(sid) == first:
                    rows.append(r)
        if len(rows) >= 2:
            ends = [*rows[1:], len(raw)]
            return [(a, b, int(raw["t_ns"][a]), int(raw["t_ns"][b]) if b < len(raw) else t_stop)
                    for a, b in zip(rows, ends, strict=True)], what
    return [(0, len(raw), cap.info.t_start_ns, t_stop)], "whole capture"


def _phase(cap: Capture, stack: Sequence[str]) -> str:
    roles = {g.scope_name: g.role for g in cap.graphs}
    roles.update({"CompiledFunctionBackward": "backward", "CompiledFunction": "forward"})
    for name in reversed(stack):
        if name in roles:
            return roles[name]
    return ""


def measure(cap: Capture, device: str | None = None, attribution: bool = True) -> Measured:
    device = device or cap.main_device
    tl = cap.timeline(device)
    windows, source = _windows(cap, device)
    excess: list[int] = []
    times: list[float] = []
    peak_pos: list[int] = []
    for start, end, t0, t1 in windows:
        rise, pos = window_rise(tl, start, end)
        excess.append(rise)
        peak_pos.append(max(pos, 0))
        times.append((t1 - t0) / 1e6)
    measured = slice(1, None) if len(windows) >= 2 else slice(None)
    ex, tm, pp = excess[measured], times[measured], peak_pos[measured]
    gc_pos = cap.gc_freed(device)
    gc_freed = max((freed_bytes(tl, gc_pos, a, b) for a, b, _t0, _t1 in windows[measured]), default=0)
    step_peak = int(statistics.median_low(ex)) if ex else None
    notes: list[str] = []
    facts = merge_facts([plan_facts(p) for p in cap.plans])
    at_peak: dict[str, int] = {}
    phase = ""
    slack = 0
    allocator = None
    labels, resident, carried = None, None, 0
    if pp and len(tl.rows):
        # the measured step whose excess is the median: what is live at its peak, and where
        k = ex.index(step_peak) if step_peak in ex else 0
        pos = pp[k]
        resident = int(tl.allocated_at_pos(pos)) - step_peak if step_peak in ex else None
        slack = block_slack(cap, tl, windows[measured][k][0], pos)
        base = rise_start(tl, windows[measured][k][0], pos)
        try:  # (attribution is a diagnosis aid; the peaks stand without it)
            labels = cap.labels(device)
            if attribution:
                from memprof.analysis.attribution import rows_at
                at_peak = {r.key: int(r.bytes) for r in rows_at(tl, labels, pos, "category") if r.bytes}
        except Exception as exc:
            notes.append(f"attribution unavailable ({one_line(exc)})")
        if cap.plans:  # (only memprof's estimate of the compiled pairs replays through it)
            allocator = model_at(cap.raw, tl, base, cap.info.alloc_conf or "")
            carried = carried_saved_bytes(labels, tl, base, windows[measured][k][0]) if labels is not None else 0
        stack = cap.scopes.stack_at(int(tl.rows[pos]), cap.info.main_thread)
        phase = _phase(cap, [cap.scope_name(s) for s in stack])
    version = cap.meta.get("torch_version")
    found, walk = estimates(cap.plans, cap.graphs, device, version if isinstance(version, str) else None,
                            cap.info.scratch_probes, allocator, tangents=cap.info.tangents_kept)
    if carried and walk is not None and walk.phase == "backward" and found["memprof"] is not None:
        found["memprof"] -= carried  # (the step rises from them: `carried_saved_bytes`)
    return Measured(
        device=device, peak=int(tl.peak), step_peak=step_peak, step_peaks=ex,
        step_ms=float(statistics.median(tm)) if tm else None, steps=len(windows), step_source=source,
        compiled=bool(cap.plans), plans=len(cap.plans), facts=facts, at_peak=at_peak, peak_phase=phase,
        buffer_level=bool(cap.graphs), estimates=found, notes=notes,
        unseen_calls=sum(c.unseen > 0 for c in labels.calls) if labels is not None else 0,
        gc_freed=gc_freed, block_slack=slack, **estimate_fields(walk),
        resident=resident,
        step_ms_p10=float(np.percentile(tm, 10)) if tm else None,
        step_ms_p90=float(np.percentile(tm, 90)) if tm else None,
    )


def block_slack(cap: Capture, tl: Timeline, start_row: int, pos: int) -> int:
    """Block bytes above the requests (rounded up to the caching allocator's 512-byte granules)
    of the allocations made from `start_row` on that are live at timeline position `pos`."""
    if tl.device == "cpu" or pos < 0:
        return 0
    live = tl.live_positions(pos)
    rows = tl.rows[live]
    raw = cap.raw
    sel = (rows >= start_row) & (raw["kind"][rows] == Kind.ALLOC) & (raw["aux"][rows] > 0)
    blocks = tl.delta_at(live)[sel].astype(np.int64)
    return int(np.clip(blocks - round_up_array(raw["aux"][rows][sel].astype(np.int64)), 0, None).sum())


def estimate_fields(walk: CaptureEstimate | None) -> dict[str, Any]:
    """Measured's estimate_* fields from memprof's estimate (`estimates`; empty where it has none)."""
    return {"estimate_at_peak": walk.at_peak if walk else {}, "estimate_peak_phase": walk.phase if walk else "",
            "estimate_unprobed": [list(u) for u in walk.unprobed] if walk else [],
            "estimate_requested": walk.requested_peak if walk else None, "estimate_blocks": bool(walk and walk.blocks)}


def estimates(plans: Sequence[Plan], graphs: Sequence[CompiledGraph], device: str, torch_version: str | None = None,
              probes: dict[str, list[Any]] | None = None, allocator: CachingAllocatorModel | None = None,
              between: OptimizerStep | None = None, tangents: Mapping[int, Sequence[str]] | None = None,
              first_calls: FirstCalls | None = None, held: Sequence[tuple[int, int]] = ()
              ) -> tuple[dict[str, float | None], CaptureEstimate | None]:
    """Compile-time predictions of the step peak, from the plans and compiled graphs recorded:
    memprof's walk of the wrapper code (`memprof.sweep.estimate`; also returned whole, with where
    its peak is and what is live there) and Inductor's own `estimate_peak_memory` (the larger of a
    pair's forward and backward), as torch computes it and with graph outputs kept live (torch 2.11
    cancels them); and the partitioner's in-tree `KnapsackEvaluator` (normalized units: compare
    its ranking only). `torch_version`: the torch the graphs ran under (a capture's; default the
    running one). `probes`: the fallback calls' scratch the capture recorded (`probe.probe_plans`):
    taken as measured, no kernel runs for them here. `allocator`: the CUDA caching allocator when the
    step began (`caching_allocator.model_at`): memprof's estimate then counts its blocks; with
    `between`, `allocator` is its state before the first step; `tangents`: what a capture saw of
    each backward's tangents; `first_calls` and `held`: a prediction's first step and the outputs its
    script held (`estimate_capture_plans`)."""
    from memprof.sweep.probe import preload
    from memprof.sweep.step_estimate import estimate_capture_plans

    preload(probes)
    out: dict[str, float | None] = {"memprof": None, "inductor": None, "inductor (outputs kept)": None,
                                    KNAPSACK: None}
    if plans and all(p.knapsack_peak is not None for p in plans):
        out[KNAPSACK] = max(float(p.knapsack_peak or 0.0) for p in plans)
    if not plans:
        return out, None
    walk: CaptureEstimate | None = None
    try:
        walk = estimate_capture_plans(plans, graphs, device, torch_version=torch_version, allocator=allocator,
                                      between=between, tangents=tangents, first_calls=first_calls, held=held)
    except Exception:  # a wrapper this walk does not understand: no estimate, never a failed sweep
        walk = None
    out["memprof"] = walk.peak if walk else None
    for key, attr in (("inductor", "inductor_estimate"), ("inductor (outputs kept)", "inductor_estimate_kept")):
        per_plan: dict[int, list[int]] = {}
        for g in graphs:
            value = getattr(g, attr)
            if g.plan is not None and value is not None and g.role in ("forward", "backward"):
                per_plan.setdefault(g.plan, []).append(value)
        if per_plan and len(per_plan) == len(plans):
            out[key] = max(max(v) for v in per_plan.values())
    return out, walk


_MEASURED_FIELDS = {f.name for f in fields(Measured)}
