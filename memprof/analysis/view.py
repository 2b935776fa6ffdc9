"""What the HTML report draws, as plain data (pure; numpy; no I/O): per device, the timeline by
category at a bounded number of exact points, step and compiled-graph bands, the allocations a
table lists at any of those points, and bytes by layer x category at the peak.

Every figure is exact where it is given: a point's bytes are the timeline's at that position (the
peak is always one of the points), a table at a point lists the allocations live there and one
row for the rest ("smaller allocations and blocks from before the capture"), so it sums to the
point's bytes; the layer x category table at the peak sums to the peak.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memprof._events import Events, Kind
from memprof.analysis.attribution import CATEGORIES, category_series
from memprof.analysis.labels import BEFORE_CAPTURE, Labels
from memprof.analysis.timeline import Timeline

MAX_POINTS = 4000  # points of a device's series (each bucket's min and max: the shape and the peak survive)
MAX_ITEMS = 20000  # allocations a device's table can list (those live at the peak, then the largest)


def downsample(values: np.ndarray, max_points: int) -> np.ndarray:
    """Indices to keep: all if few, else each bucket's start, its first minimum and first maximum,
    and both ends (vectorized: a long capture's timeline has millions of points)."""
    n = len(values)
    if n <= max_points:
        return np.arange(n)
    buckets = max(1, max_points // 2 - 1)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    starts = edges[:-1][edges[1:] > edges[:-1]]
    bucket = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
    keep = [np.asarray([0, n - 1], dtype=np.int64), starts]
    for extreme in (np.maximum.reduceat(values, starts), np.minimum.reduceat(values, starts)):
        hits = np.flatnonzero(values == extreme[bucket])
        keep.append(hits[np.unique(bucket[hits], return_index=True)[1]])  # the first in each bucket
    return np.unique(np.concatenate(keep))


def _items(tl: Timeline, max_items: int) -> np.ndarray:
    """Timeline positions of the allocations the page lists: all live at the peak, then the largest."""
    allocs = np.flatnonzero(tl.is_alloc)
    at_peak = tl.live_positions(tl.peak_pos) if tl.peak_pos >= 0 else np.zeros(0, np.int64)
    rest = np.setdiff1d(allocs, at_peak, assume_unique=False)
    room = max(0, max_items - len(at_peak))
    if len(rest) > room:
        rest = rest[np.argsort(-tl.delta_at(rest), kind="stable")[:room]]
    return np.sort(np.concatenate([at_peak, rest]).astype(np.int64))


def device_view(tl: Timeline, labels: Labels, raw: Events, t0: int, steps: list[dict[str, Any]],
                max_points: int = MAX_POINTS, max_items: int = MAX_ITEMS) -> dict[str, Any]:
    """One device's part of the page (positions are timeline positions; times in seconds from `t0`)."""
    keep = downsample(tl.allocated, max_points) if len(tl.rows) else np.zeros(0, np.int64)
    if tl.peak_pos >= 0 and tl.peak_pos not in set(keep.tolist()):
        keep = np.sort(np.append(keep, tl.peak_pos))
    series = category_series(tl, labels, keep)
    present = [c for c in range(len(CATEGORIES)) if series[:, c].any()]
    secs = ((tl.t_ns - t0) / 1e9).round(6)
    items = _items(tl, max_items)
    free = tl.free_of[items]
    n = len(tl.rows)
    names = labels.names
    used = sorted({0, *labels.node[items].tolist(), *labels.layer[items].tolist(), *labels.kernel[items].tolist()})
    remap = {old: new for new, old in enumerate(used)}
    row_of = tl.rows[items]
    last = len(raw) - 1
    calls = [{"role": c.role, "key": c.key, "t0": float((int(raw["t_ns"][c.begin_row]) - t0) / 1e9),
              "t1": float((int(raw["t_ns"][min(c.end_row, last)]) - t0) / 1e9),
              "p0": tl.pos_before_row(c.begin_row) + 1, "p1": tl.pos_before_row(c.end_row)} for c in labels.calls]
    ooms = [{"t": (int(raw["t_ns"][r]) - t0) / 1e9, "pos": tl.pos_before_row(int(r)), "requested": int(raw["bytes"][r])}
            for r in np.flatnonzero(raw["kind"] == Kind.OOM).tolist()]
    return {
        "device": tl.device, "peak": int(tl.peak), "peak_pos": int(tl.peak_pos), "baseline": int(tl.baseline),
        "peak_t": float(secs[tl.peak_pos]) if tl.peak_pos >= 0 else 0.0,
        "categories": [CATEGORIES[c] for c in present],
        "points": {"pos": keep.tolist(), "t": secs[keep].tolist(), "total": tl.allocated[keep].tolist(),
                   "by_category": series[:, present].T.tolist()},
        "strings": [names[i] or "" for i in used],
        "items": {"alloc": items.tolist(), "free": np.where(free >= 0, free, n).tolist(),
                  "t": secs[items].tolist(), "bytes": tl.delta_at(items).tolist(),
                  "category": labels.category[items].astype(int).tolist(),
                  "node": [remap[int(i)] for i in labels.node[items]],
                  "layer": [remap[int(i)] for i in labels.layer[items]],
                  "kernel": [remap[int(i)] for i in labels.kernel[items]],
                  "stream": raw["stream"][row_of].astype(np.int64).tolist()},
        "steps": steps, "calls": calls, "ooms": ooms, "events": n,
        "layer_category": layer_category(tl, labels, tl.peak_pos),
    }


def layer_category(tl: Timeline, labels: Labels, pos: int) -> dict[str, dict[str, int]]:
    """Bytes live at position `pos` by layer and category; sums to the bytes allocated there."""
    out: dict[str, dict[str, int]] = {}
    total = tl.allocated_at_pos(pos)
    live = tl.live_positions(pos) if pos >= 0 else np.zeros(0, np.int64)
    for layer, cat, size in zip(labels.layer[live].tolist(), labels.category[live].tolist(),
                                tl.delta_at(live).tolist(), strict=True):
        row = out.setdefault(labels.names[layer] or "(unknown)", {})  # (as `rows_at` names it)
        row[CATEGORIES[cat]] = row.get(CATEGORIES[cat], 0) + int(size)
    rest = total - int(tl.delta_at(live).sum())
    if rest:
        out.setdefault(BEFORE_CAPTURE, {})["unattributed"] = rest
    return out


def step_bands(tl: Timeline, t0: int, steps: list[Any]) -> list[dict[str, Any]]:
    """Steps as bands: number, start and end (seconds from `t0`, and timeline positions) and peak
    (`Capture.steps` of `tl`'s device)."""
    return [{"step": s.step, "t0": (s.t_start_ns - t0) / 1e9, "t1": (s.t_end_ns - t0) / 1e9, "peak": int(s.peak),
             "complete": bool(s.complete), "p0": tl.pos_before_row(s.start_row) + 1,
             "p1": tl.pos_before_row(s.end_row)} for s in steps]
