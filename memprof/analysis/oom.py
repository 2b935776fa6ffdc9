"""OOM forensics: what a capture says about each out-of-memory it recorded (pure analysis).

For each OOM event: the failed request (bytes, device, stream, the op running), the device's free
and total memory; device memory split into allocated by PyTorch, reserved but unallocated
(fragmentation) and outside PyTorch (total - free - reserved: the CUDA context, cuBLAS/cuDNN
workspaces, NCCL, other processes); what was live by category, FX node, layer and age, each
summing exactly to the allocated bytes at the OOM; the last steps' peaks before it; what limits
the figures; the run's configuration; and a next step computed from these figures.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from memprof._events import Kind, device_name
from memprof.analysis.attribution import AttributionRow, rows_at
from memprof.analysis.units import MB, fmt_bytes

if TYPE_CHECKING:
    from memprof.capture import Capture

# reserved-but-unallocated bytes worth the allocator's expandable segments: above the request, or
# above this share of the device
FRAGMENTATION_SHARE = 0.05
OUTSIDE_SHARE = 0.05  # memory outside PyTorch worth naming, as a share of the device
ACTIVATIONS = ("saved_activation", "recomputed", "rng_mask")  # the categories another budget trades
# the budgets the next step's sweep predicts: 0 to 1, since a lower budget can peak higher than a
# higher one (the partitioner's knapsack), finer where budgets usually matter
SWEEP_BUDGETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 1.0)


@dataclass(frozen=True)
class OomReport:
    device: str
    requested_bytes: int
    free_bytes: int | None  # what the driver said was free (CUDA tracker)
    t_s: float
    scope: str  # the op or kernel that asked
    stream: int
    step: int  # the step it happened in (1: the first, compiling one)
    total_bytes: int | None  # the device's memory
    allocated_bytes: int  # live in PyTorch's allocator at the OOM (captured + baseline)
    reserved_bytes: int | None  # reserved by the caching allocator at the OOM
    fragmentation_bytes: int | None  # reserved but unallocated
    outside_bytes: int | None  # total - free - reserved
    by_category: list[AttributionRow]
    by_node: list[AttributionRow]
    by_layer: list[AttributionRow]
    by_age: list[tuple[str, int]]  # (this step | earlier steps | before the capture, bytes)
    last_steps: list[tuple[int, int]]  # (step, peak bytes) of the steps before it
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    next_steps: list[str] = field(default_factory=list)
    # the most a step may allocate above its start and fit: the free bytes plus what this step had
    # allocated (the device less what was outside PyTorch, what the step began with and the
    # fragmentation at the OOM); None without the driver's free figure
    fit_bytes: int | None = None
    sweep_command: list[str] | None = None  # the `memprof sweep --predict` that the next step names


def _by_age(cap: Capture, device: str, pos: int, step_start: int, allocated: int) -> list[tuple[str, int]]:
    tl = cap.timeline(device)
    live = tl.live_positions(pos) if pos >= 0 else np.zeros(0, np.int64)
    this_step = int(tl.delta_at(live[tl.rows[live] >= step_start]).sum())
    earlier = int(tl.delta_at(live).sum()) - this_step
    return [("allocated in this step", this_step), ("allocated in earlier steps", earlier),
            ("allocated before the capture", allocated - this_step - earlier)]


def _next_steps(r: OomReport, cap: Capture) -> list[str]:
    """What to try, from this OOM's own figures."""
    out: list[str] = []
    if r.free_bytes is not None:
        out.append(f"the request needed {fmt_bytes(r.requested_bytes - r.free_bytes)} more than the "
                   f"{fmt_bytes(r.free_bytes)} the device had free")
    conf = str(r.config.get("PYTORCH_CUDA_ALLOC_CONF") or "")
    frag = r.fragmentation_bytes
    large = frag is not None and r.total_bytes and (frag >= r.requested_bytes
                                                      or frag > FRAGMENTATION_SHARE * r.total_bytes)
    if frag is not None and large and "expandable_segments:True" not in conf:
        out.append(f"{fmt_bytes(frag)} were reserved but unallocated (fragmentation), "
                   f"{'more than the request' if frag >= r.requested_bytes else 'a large share of the device'}: "
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the allocator reuse them")
    if r.outside_bytes is not None and r.total_bytes and r.outside_bytes > OUTSIDE_SHARE * r.total_bytes:
        out.append(f"{fmt_bytes(r.outside_bytes)} of the device were outside PyTorch's allocator (CUDA context, "
                   "library workspaces, NCCL, other processes)")
    command = r.sweep_command
    if command is not None:
        recomputed = sum(x.bytes for x in r.by_category if x.key == "recomputed")
        saved = sum(x.bytes for x in r.by_category if x.key in ACTIVATIONS) - recomputed
        fits = "" if r.fit_bytes is None else (
            f"; a budget whose predicted step peak is under {fmt_bytes(r.fit_bytes)} (the free memory and what "
            "this step had allocated) fits")
        out.append(f"{fmt_bytes(saved + recomputed)} at the OOM were activations ({fmt_bytes(saved)} saved for the "
                   f"backward, {fmt_bytes(recomputed)} recomputed in it): another activation_memory_budget "
                   "saves and recomputes others (a lower one can also peak higher); "
                   f"`{shlex.join(command)}` predicts each budget's step peak without running a step{fits}; "
                   "`--remat light` added to it predicts memprof's remat pass too")
    return out


def _sweep_command(r: OomReport, cap: Capture) -> list[str] | None:
    """`memprof sweep SCRIPT ARGS --budgets ... --predict --jobs J`, where activations were live at
    the OOM and the capture recorded plans: one process per budget, the budgets compiled in
    parallel, their forwards taking the device in turns (`memprof.sweep.predict.DeviceTurn`)."""
    argv = cap.meta.get("argv")
    activations = sum(x.bytes for x in r.by_category if x.key in ACTIVATIONS)
    if not (cap.plans and activations and isinstance(argv, list) and argv):
        return None
    budgets = set(SWEEP_BUDGETS)
    budget = cap.meta.get("budget")
    if isinstance(budget, (int, float)) and 0 <= float(budget) <= 1:
        budgets.add(float(budget))  # the budget that ran out, for comparison
    return ["memprof", "sweep", *map(str, argv), "--budgets", ",".join(f"{b:g}" for b in sorted(budgets)),
            "--predict", "--jobs", str(len(budgets))]


def oom_reports(cap: Capture, top: int = 8) -> list[OomReport]:
    """One report per OOM event the capture holds, in order."""
    raw, info = cap.raw, cap.info
    t0 = cap.t0_ns
    markers = np.flatnonzero(raw["kind"] == Kind.STEP)
    out: list[OomReport] = []
    for row in np.flatnonzero(raw["kind"] == Kind.OOM).tolist():
        dev = device_name(int(raw["device_type"][row]), int(raw["device_index"][row]))
        tl = cap.timeline(dev) if dev in cap.devices else None
        before = markers[markers < row]
        step = int(raw["bytes"][before[-1]]) + 1 if len(before) else 1
        step_start = int(before[-1]) + 1 if len(before) else 0
        free = int(raw["aux"][row]) if int(raw["aux"][row]) >= 0 else None
        total = info.device_total.get(dev)
        pos = tl.pos_before_row(row) if tl is not None else -1
        allocated = tl.allocated_at_pos(pos) if tl is not None else 0
        reserved = tl.reserved_before_row(row) if tl is not None else None
        labels = cap.labels(dev) if tl is not None else None
        rows = {by: rows_at(tl, labels, pos, by) for by in ("category", "node", "layer")} if tl and labels else {}
        steps = [s for s in cap.steps(dev, tail=True) if s.complete and s.end_row <= row] if tl else []
        report = OomReport(
            device=dev, requested_bytes=int(raw["bytes"][row]), free_bytes=free,
            t_s=(int(raw["t_ns"][row]) - t0) / 1e9, scope=cap.scope_name(int(raw["scope"][row])),
            stream=int(raw["stream"][row]), step=step, total_bytes=total, allocated_bytes=allocated,
            reserved_bytes=reserved, fragmentation_bytes=None if reserved is None else reserved - allocated,
            outside_bytes=None if total is None or free is None or reserved is None else total - free - reserved,
            by_category=rows.get("category", []), by_node=rows.get("node", [])[:top],
            by_layer=rows.get("layer", [])[:top],
            by_age=_by_age(cap, dev, pos, step_start, allocated) if tl is not None else [],
            last_steps=[(s.step, s.peak) for s in steps[-3:]], notes=list(cap.caveats),
            config={"activation_memory_budget": cap.meta.get("budget"), "remat": cap.meta.get("remat"),
                    "allocator_backend": cap.meta.get("allocator_backend"),
                    "PYTORCH_CUDA_ALLOC_CONF": info.alloc_conf, "torch": cap.meta.get("torch_version"),
                    "cuda": cap.meta.get("cuda_version"), "memprof": cap.meta.get("memprof_version")})
        if free is not None and report.by_age:
            report = dataclasses.replace(report, fit_bytes=free + report.by_age[0][1])
        report = dataclasses.replace(report, sweep_command=_sweep_command(report, cap))
        out.append(dataclasses.replace(report, next_steps=_next_steps(report, cap)))
    return out


def format_oom(r: OomReport) -> list[str]:
    """The OOM section of the text summary."""
    def mb(n: int | None) -> str:
        return "unknown" if n is None else f"{n / MB:,.1f} MB"

    lines = [f"OUT OF MEMORY on {r.device} at {r.t_s:.3f}s, in step {r.step}: requested "
             f"{fmt_bytes(r.requested_bytes)} ({r.requested_bytes:,} B) on stream {r.stream} "
             f"(in {r.scope or 'no scope'})"]
    lines.append(f"  device: {mb(r.total_bytes)} total, {mb(r.free_bytes)} free; allocated by PyTorch "
                 f"{mb(r.allocated_bytes)}, reserved but unallocated {mb(r.fragmentation_bytes)}, "
                 f"outside PyTorch {mb(r.outside_bytes)}")
    for title, rows in (("by category", r.by_category), ("by FX node", r.by_node), ("by layer", r.by_layer)):
        if rows:
            lines.append(f"  live at the OOM {title} (of {fmt_bytes(r.allocated_bytes)}):")
            lines.extend(f"    {fmt_bytes(x.bytes):>10}  {x.key}" for x in rows)
    if r.by_age:
        lines.append("  by age: " + ", ".join(f"{what} {fmt_bytes(b)}" for what, b in r.by_age))
    if r.last_steps:
        lines.append("  the steps before: " + ", ".join(f"step {s} peaked at {fmt_bytes(p)}" for s, p in r.last_steps))
    lines.extend(f"  note: {n}" for n in r.notes)
    lines.append("  config: " + ", ".join(f"{k}={v}" for k, v in r.config.items() if v is not None))
    lines.extend(f"  next: {n}" for n in r.next_steps)
    return lines
