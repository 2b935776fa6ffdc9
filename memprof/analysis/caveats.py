"""What limits a capture's figures, in words: one line each, most important first (`Capture.caveats`;
reporters print them next to the headline figures, not at the bottom)."""

from __future__ import annotations

from typing import Any

from memprof._events import Events, Kind
from memprof.analysis.window import window_caveats
from memprof.capture_info import CaptureInfo, budget_problem


def capture_caveats(info: CaptureInfo, raw: Events, problems: list[str], budget: Any) -> list[str]:
    """The caveats of a capture with these metadata, events, consistency problems
    (`Capture.problems`) and budget."""
    out: list[str] = []
    t0 = info.t_start_ns
    if problems:
        out.append(f"INCONSISTENT: the events hold what no real capture does ({'; '.join(problems)}): "
                   "its figures cannot be vouched for (a file edited or made by hand?)")
    if info.dropped_events:
        when = f" from {(info.first_dropped_ns - t0) / 1e9:.2f} s on" if info.first_dropped_ns is not None else ""
        kept = int((raw["kind"] == Kind.STEP).sum()) if info.steps else 0
        of_steps = f"; {kept} of the {info.steps} steps were captured whole" if info.steps else ""
        out.append(f"INCOMPLETE: {info.dropped_events:,} events were dropped{when} (max_events="
                   f"{info.max_events:,}){of_steps}: every peak is a lower bound; raise --max-events")
    if info.recovered_from and info.spill_live:
        out.append(f"INCOMPLETE: the run is still going (its memprof holds the spill {info.recovered_from}): "
                   f"this is what it recorded up to {(info.t_stop_ns - t0) / 1e9:.2f} s; every peak is a lower "
                   "bound until it saves the capture")
    elif info.recovered_from:
        out.append(f"INCOMPLETE: the run was cut short before memprof could save it (killed, os._exit or a "
                   f"crash); recovered from its spill {info.recovered_from}, which holds the events up to "
                   f"{(info.t_stop_ns - t0) / 1e9:.2f} s (at most the last half second before the end is lost): "
                   "every peak is a lower bound")
    if info.stopped_by:
        at = f" at {(info.t_stop_ns - t0) / 1e9:.2f} s" if info.t_stop_ns else ""
        out.append(f"INCOMPLETE: the capture stopped{at} when the script started {info.stopped_by} "
                   "(they share PyTorch's profiler slot): later allocations are not captured, so the "
                   "peak is the peak up to there")
    if info.window is not None or info.keep_last:
        out.extend(window_caveats(info, raw))
    if info.cpu_threads is not None and info.cpu_threads != "all":
        out.append(f"cpu: only the capturing thread and its autograd threads were seen ({info.cpu_threads}); "
                   "allocations and frees on other threads are missing")
    if info.dataloader_workers:
        out.append(f"{info.dataloader_workers} DataLoader worker process(es) ran (num_workers > 0): what they "
                   "allocate is in other processes, and the batches they hand over arrive in shared memory, "
                   "which no PyTorch allocator reports; neither is captured")
    limits = info.recompile_limits
    if limits:
        out.append(f"Dynamo hit {limits[0][:200]}: later calls of that code ran eagerly, not compiled, "
                   "so their memory is the eager run's" + (f" ({len(limits)} such frames)" if len(limits) > 1
                                                           else ""))
    budget = budget_problem(budget)
    if budget is not None:
        out.append(f"{budget} (JSON shows it as null)")
    if info.child_processes:
        out.append(f"{info.child_processes} other child process(es) forked or started with multiprocessing: "
                   "their allocations are not captured")
    return out
