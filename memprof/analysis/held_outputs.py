"""Outputs of compiled forwards that the script still holds where its memory peaks.

A compiled forward's buffer that outlives its call and that no backward saves is an output the
caller took: the loss, and anything returned beside it (a model's logits, in `logits, loss =
model(x, y)`). Held in a variable, it stays live through the backward and until the next step's
forward returns its successor, though the backward never reads it. The join labels such a buffer
`fw<plan>:<node>`, category temporary (a saved one is a saved activation); live at a peak outside
every forward call, it is one of these. Deleting it once used (`del logits` before the backward)
frees it for the backward.
"""

from __future__ import annotations

import numpy as np

from memprof.analysis.labels import Category, Labels
from memprof.analysis.timeline import Timeline

ADVICE = ("outputs of compiled forwards the script still held there, which no backward reads ({nodes}: e.g. "
          "logits kept beside the loss); deleting them once used (`del logits` before `loss.backward()`) frees them")
SHARE = 0.01  # of the peak: below it (the loss itself, a few bytes) nothing is said


def held_output_bytes(labels: Labels, tl: Timeline, live: np.ndarray, peak_row: int) -> tuple[int, list[str]]:
    """Bytes of such outputs among the live allocations at timeline positions `live` (those at a
    peak at row `peak_row`), and the FX nodes of those over `SHARE` of it, largest first; (0, [])
    where the peak is inside a forward call (its own buffers are live there) or they are under
    `SHARE` of what is live."""
    if any(c.role == "forward" and c.begin_row <= peak_row <= c.end_row for c in labels.calls):
        return 0, []
    mine = live[_made_by_forwards(labels, live) & (labels.category[live] == Category.TEMPORARY)]
    sizes = tl.delta_at(mine)
    total, floor = int(sizes.sum()), SHARE * int(tl.delta_at(live).sum())
    if not len(mine) or total < floor:
        return 0, []
    order = np.argsort(-sizes, kind="stable")
    nodes = dict.fromkeys(labels.names[int(labels.node[p])] for p, b in zip(mine[order], sizes[order], strict=True)
                          if b >= floor)
    return total, list(nodes)


def carried_saved_bytes(labels: Labels, tl: Timeline, pos: int, start_row: int) -> int:
    """Bytes live at timeline position `pos` (where a measured step's rise starts) that a compiled
    forward of an earlier step made and its plan saved (allocated before row `start_row`, the step's
    start): kept past that step's backward, an output the script still holds (`loss, logits =
    step(x)` where the plan saves the logits). A step's measured peak counts them in what it rises
    from; memprof's estimate of the step counts the step's own copy in the step, as the saved value
    it is, and the step frees the earlier one when its forward returns."""
    if pos < 0:
        return 0
    live = tl.live_positions(pos)
    live = live[tl.rows[live] < start_row]
    cats = labels.category[live]
    saved = (cats == Category.SAVED_ACTIVATION) | (cats == Category.RNG_MASK)
    return int(tl.delta_at(live[_made_by_forwards(labels, live) & saved]).sum())


def _made_by_forwards(labels: Labels, positions: np.ndarray) -> np.ndarray:
    """Per position: its FX node is a compiled forward's (`fw<plan>:<node>`, `join.call_tag`)."""
    forward = np.asarray([name.startswith("fw") for name in labels.names], dtype=bool)
    return np.asarray(forward[labels.node[positions]])
