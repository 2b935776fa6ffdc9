"""What a capture of some steps only (a step window, a ring of the last steps) holds, in words."""

from __future__ import annotations

import numpy as np

from memprof._events import FLAG_CARRIED, Events, Kind, kind_mask
from memprof.analysis.units import fmt_bytes
from memprof.capture_info import CaptureInfo


def never_opened(info: CaptureInfo) -> str | None:
    """Why a step window holds nothing (None: it opened, or the capture has none)."""
    if info.window is None or info.window_state != "pending":
        return None
    first, last = info.window
    made = f"only {info.steps} step{'s' if info.steps != 1 else ''}" if info.steps else "no step"
    return (f"the step window {first}:{last} never opened: the script made {made} (a step ends at each "
            "optimizer step, or at memprof.step()); the capture holds its compile plans and no events")


def carried_count(raw: Events) -> int:
    """Events carried into a step window or a ring of the last steps (FLAG_CARRIED: the blocks live
    where the stored steps begin); they lead the capture."""
    carried = (raw["flags"] & FLAG_CARRIED) != 0
    return int(np.argmin(carried)) if len(raw) and not carried.all() else int(carried.sum())


def window_caveats(info: CaptureInfo, raw: Events) -> list[str]:
    """One line each: which steps are stored, and what was carried into them."""
    empty = never_opened(info)
    if empty is not None:
        return [f"EMPTY: {empty}"]
    markers = raw["bytes"][raw["kind"] == Kind.STEP]
    carried = (raw["flags"] & FLAG_CARRIED) != 0
    blocks = carried & kind_mask(raw["kind"], [Kind.ALLOC, Kind.CUDA_ALLOC])
    out: list[str] = []
    if info.window is not None:
        first, last = info.window
        if info.window_state == "open" and info.steps < last:
            stored = (f"steps {first}-{info.steps} are stored, then the script's end" if info.steps >= first
                      else "none of its steps completed (what ran up to the script's end is stored)")
            out.append(f"the step window {first}:{last} was cut short: the script made only {info.steps} "
                       f"step{'s' if info.steps != 1 else ''}, so {stored}")
        else:
            out.append(f"steps {first}-{last} of the run's {info.steps} are stored (a step window): peaks and "
                       "attribution are those of the window")
    elif info.keep_last and len(markers) and carried.any():
        lo = int(markers.min()) + 1
        out.append(f"the last {info.keep_last} steps are stored (steps {lo}-{info.steps}"
                   f"{' and the one in progress' if info.status not in (None, 'completed', 'exit') else ''}, "
                   "a ring): peaks and attribution are those of these steps")
    if blocks.any():
        out.append(f"{int(blocks.sum()):,} blocks ({fmt_bytes(int(raw['bytes'][blocks].sum()))}) live when the stored "
                   "steps began are carried in with their own allocation events and the scopes they were made "
                   "in: their bytes are exact, and each is labelled as a full capture labels it (joined to its "
                   "compiled graph's buffer and FX node, or named as a parameter, gradient or optimizer state)")
    return out
