"""A prediction replayed against the run that measured it: what a compile-time prediction of a
capture's steps would have started from, read from the capture itself (the caching allocator just
before the first compiled-graph call, where a prediction snapshots it, and the optimizer state the
first step made), so that the prediction's model of the steps can be set beside the measured ones
with everything else equal (`tools/replay_prediction.py`; the unit tests' GQA fixture)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from memprof._events import Kind
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

    tl, raw = cap.timeline(device), cap.raw
    begins = np.flatnonzero(raw["kind"] == Kind.SCOPE_BEGIN)
    first = next((int(r) for r in begins if cap.scope_name(int(raw["scope"][r])).startswith("## Call CompiledFxGraph")),
                 None)
    windows, _ = _windows(cap, device)
    if first is None or not windows:
        return None
    preload(cap.info.scratch_probes)
    before = model_at(raw, tl, tl.pos_before_row(first))
    if before is None:
        return None
    labels = cap.labels(device)
    start, end = windows[0][0], windows[0][1]
    state = [int(raw["aux"][r]) for i, r in enumerate(tl.rows.tolist())
             if start <= r < end and tl.is_alloc[i] and labels.category[i] == Category.OPTIMIZER_STATE]
    return before, state
