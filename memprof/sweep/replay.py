"""A prediction replayed against the run that measured it: what a compile-time prediction of a
capture's steps would have started from, read from the capture itself (the caching allocator just
before the first compiled-graph call, where a prediction snapshots it, and the optimizer state the
first step made), so that the prediction's model of the steps can be set beside the measured ones
with everything else equal (`tools/replay_prediction.py`; the unit tests' GQA fixture)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memprof.analysis.attribution import Category
from memprof.analysis.caching_allocator import CachingAllocatorModel, model_at

if TYPE_CHECKING:
    from memprof.capture import Capture


def prediction_inputs(cap: Capture, device: str) -> tuple[CachingAllocatorModel, list[int]] | None:
    """The allocator model as it was before the first compiled-graph call, and the requests of the
    optimizer state made in the first step (what `OptimizerStep` allocates between the steps); None
    where the capture has no compiled-graph call or its allocator cannot be replayed."""
    from memprof.sweep.measure import _windows
    from memprof.sweep.probe import preload

    tl, raw, labels = cap.timeline(device), cap.raw, cap.labels(device)
    first = min((c.begin_row for c in labels.calls), default=None)  # (the first call's scope begins there)
    windows, _ = _windows(cap, device)
    if first is None or not windows:
        return None
    preload(cap.info.scratch_probes)
    before = model_at(raw, tl, tl.pos_before_row(first))
    if before is None:
        return None
    start, end = windows[0][0], windows[0][1]
    made = (tl.rows >= start) & (tl.rows < end) & tl.is_alloc & (labels.category == Category.OPTIMIZER_STATE)
    return before, [int(b) for b in raw["aux"][tl.rows[made]]]
