"""`memprof export --format snapshot`: the capture as a memory_viz snapshot, the pickle
`torch.cuda.memory._dump_snapshot` writes (for pytorch.org/memory_viz and `torch.cuda._memory_viz`;
`memprof.snapshot` reads it back).

It follows what the viewer needs (`../shared/notes/next-features.md` §1): pickle protocol 4 (its
JavaScript unpickler leaves protocol 5 files blank), every allocation and free with its address,
size and stream, memprof's category on each, its FX node, layer and kernel in its frames, and one
synthetic segment per device that the blocks live at the end tile.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from memprof._events import parse_device
from memprof.analysis.labels import CATEGORIES
from memprof.capture import Capture
from memprof.errors import MemprofError
from memprof.reporters.registry import Reporter, register
from memprof.snapshot import KEY

PROTOCOL = 4


@dataclass(frozen=True)
class SnapshotOptions:
    device: str | None = None  # None: the main device


def _write_snapshot(cap: Capture, o: SnapshotOptions, out: IO[bytes]) -> None:
    out.write(dump(to_snapshot(cap, o.device)))


def to_snapshot(cap: Capture, device: str | None = None) -> dict[str, Any]:
    """The capture's timeline on `device` (default: the main one) as a memory_viz snapshot."""
    device = device or cap.main_device
    if device not in cap.devices:
        raise MemprofError(f"no allocations on {device} in this capture (devices: {', '.join(cap.devices)})")
    tl, labels, raw = cap.timeline(device), cap.labels(device), cap.raw
    index = 0 if device == "cpu" else parse_device(device)[1]
    names = labels.names
    entries: list[dict[str, Any]] = []
    frames_of: dict[tuple[int, int, int, int], list[dict[str, Any]]] = {}
    live: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    cats = [("unknown" if c == "unattributed" else c) for c in CATEGORIES]
    sizes, times_us = np.abs(tl.delta).tolist(), (tl.t_ns // 1000).tolist()
    for i in range(len(tl.rows)):
        r = int(tl.rows[i])
        addr, size = int(raw["ptr"][r]), sizes[i]
        key = (int(labels.node[i]), int(labels.layer[i]), int(labels.kernel[i]), int(raw["scope"][r]))
        frames = frames_of.get(key)
        if frames is None:
            node, layer, kernel = names[key[0]], names[key[1]], names[key[2]]
            frames = [{"filename": layer or "memprof", "line": 0, "name": f"{node} [{kernel}]" if kernel else node,
                       "fx_node_name": node, "fx_node_op": kernel, "fx_original_trace": cap.scope_name(key[3])}]
            frames_of[key] = frames
        common = {"addr": addr, "size": size, "stream": int(raw["stream"][r]), "time_us": times_us[i],
                  "frames": frames, "compile_context": "", "user_metadata": ""}
        if tl.is_alloc[i]:
            entries.append({"action": "alloc", **common, "category": cats[int(labels.category[i])]})
            live[addr] = (size, frames)
        else:
            # the free request carries 'unknown': memory_viz throws when no event's category is
            # 'unknown' (a typo upstream), and it folds the request and its completion into one
            # free, which takes its category from the allocation it ends
            entries.append({"action": "free_requested", **common, "category": "unknown"})
            entries.append({"action": "free_completed", **common, "category": cats[int(labels.category[i])]})
            live.pop(addr, None)
    pre = cap.info.preexisting.get(device, [])
    pre_labels = len(labels.pre_size) == len(pre)
    freed = {e["addr"] for e in entries if e["action"] == "free_completed"}
    allocated = {e["addr"] for e in entries if e["action"] == "alloc"}
    for j, (ptr, size) in enumerate(pre):  # blocks from before the capture never freed in it
        if ptr not in live and ptr not in freed and ptr not in allocated:
            node = names[int(labels.pre_node[j])] if pre_labels else ""
            cat = cats[int(labels.pre_category[j])] if pre_labels else "unknown"
            live[ptr] = (size, [{"filename": "memprof", "line": 0, "name": node, "fx_node_name": node,
                                 "category": cat}])
    traces: list[list[dict[str, Any]]] = [[] for _ in range(index + 1)]
    traces[index] = entries
    return {"segments": _segments(index, live), "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": str(cap.meta.get("alloc_conf") or ""),
                                   "trace_alloc_max_entries": len(entries), "trace_alloc_overflowed": False},
            "external_annotations": [], KEY: {"devices": {str(index): device}}}


def _segments(index: int, live: dict[int, tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One segment covering the blocks live at the end, padded with inactive blocks between them
    (the viewer replays its history backwards from here: every block it ends with must tile a
    live segment, as torch's own `_profile_to_snapshot` builds it)."""
    if not live:
        return []
    start = min(live)
    blocks: list[dict[str, Any]] = []
    at = start
    for addr in sorted(live):
        size, frames = live[addr]
        if addr > at:
            blocks.append({"address": at, "size": addr - at, "requested_size": 0, "state": "inactive", "frames": []})
        # (the block's category rides in its first frame, which the viewer shows as a name)
        blocks.append({"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                       "frames": frames, "category": frames[0].get("category", "unknown") if frames else "unknown"})
        at = addr + size
    total = at - start
    active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return [{"device": index, "address": start, "total_size": total, "allocated_size": active,
             "active_size": active, "requested_size": active, "stream": 0, "segment_type": "large",
             "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}]


def dump(snapshot: dict[str, Any]) -> bytes:
    return pickle.dumps(snapshot, protocol=PROTOCOL)


register(Reporter("snapshot", "export", ".pickle",
                  "memory_viz snapshot (pickle protocol 4, memprof's categories and FX nodes)",
                  SnapshotOptions, _write_snapshot, binary=True))
