"""memory_viz snapshots read as captures: the pickle `torch.cuda.memory._dump_snapshot` writes (or
memprof's own export of one, `memprof.reporters.snapshot`), so that `memprof report`, `diff` and
`export` work on it.

Reading never runs code from the file: a real snapshot is built in C++ from dicts, lists, strings,
numbers, booleans and None, so the unpickler refuses every global (a pickle that names one is
not a snapshot, whatever it claims), and files over a size cap are refused before they are read.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from memprof._events import EVENT_DTYPE, Events, Kind, parse_device
from memprof.analysis.caching_allocator import round_size
from memprof.analysis.labels import CATEGORIES
from memprof.capture_info import MAX_BLOCK_BYTES, MAX_TIME_NS
from memprof.errors import CaptureFileError, MemprofError
from memprof.fileformat import Parts
from memprof.plans import KnownTensor

DEFAULT_MAX_BYTES = 512 * 10**6  # a snapshot's pickle takes about 10x its size in Python objects
_MAX_ENV = "MEMPROF_MAX_SNAPSHOT_MB"
# torch.profiler's memory categories (as `_profile_to_snapshot` writes them) in memprof's terms
_TORCH_CATEGORIES = {"activation": "saved_activation", "autograd_detail": "temporary"}
# the caching allocator hands a whole free block to a request when splitting it would leave less than
# 1 MiB (large blocks): the trace holds only the request, so those count as their rounded request
CUDA = parse_device("cuda:0")[0]
UNSPLIT_NOTE = ("the allocator handed out some blocks whole (larger than their rounded request; the segments "
                "show them at the end): the trace holds requests, so its peak can be below max_memory_allocated")
KEY = "memprof"  # memprof's own top-level entry: which device each trace is (the viewer ignores it)


# ------------------------------------------------------------------------------------------ reading
class _Global(pickle.UnpicklingError):
    pass


class _PlainData(pickle.Unpickler):
    """An unpickler that builds only plain data: any global (a class, a function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Global(f"it names {module}.{name}")


def is_pickle(path: Path) -> bool:
    """Whether the file starts as a pickle of protocol 2 or later does (a .memprof is a zip: 'PK')."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
    except OSError:
        return False
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def max_bytes() -> int:
    value = os.environ.get(_MAX_ENV)
    if value:
        try:
            return int(float(value) * 10**6)
        except ValueError:
            raise MemprofError(f"{_MAX_ENV}={value!r} is not a number of MB") from None
    return DEFAULT_MAX_BYTES


def read(path: Path, limit: int | None = None) -> dict[str, Any]:
    """A snapshot's data, unpickled with no globals, after checking its size against `limit`."""
    limit = max_bytes() if limit is None else limit
    size = path.stat().st_size
    if size > limit:
        raise CaptureFileError(f"{path}: {size / 1e6:.1f} MB, over memprof's {limit / 1e6:.0f} MB cap for snapshots "
                               f"(set {_MAX_ENV} to read it)")
    try:
        data = _PlainData(io.BytesIO(path.read_bytes())).load()
    except _Global as exc:
        raise CaptureFileError(f"{path}: not a memory snapshot: {exc} (a snapshot holds only plain data, "
                               "so memprof does not load it)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError, RecursionError, OverflowError) as exc:
        raise CaptureFileError(f"{path}: not a readable pickle ({type(exc).__name__}: {exc})") from None
    problem = _shape_problem(data)
    if problem:
        raise CaptureFileError(f"{path}: not a memory snapshot ({problem})")
    return data  # type: ignore[no-any-return]


def _whole(v: Any, top: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= top


def _shape_problem(data: Any) -> str | None:
    """What makes `data` no snapshot memprof can read (None: nothing): the containers, and every
    number memprof uses in range (addresses and streams 64-bit, sizes as a capture's blocks)."""
    if not isinstance(data, dict):
        return f"a {type(data).__name__}, not a dict"
    traces, segments = data.get("device_traces"), data.get("segments")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        return "no device_traces list"
    if len(traces) > 128:
        return f"{len(traces)} device traces"
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        return "no segments list"
    limits = {"addr": 1 << 64, "size": MAX_BLOCK_BYTES, "stream": 1 << 64, "time_us": MAX_TIME_NS // 1000}
    for t in traces:
        for e in t:
            if not isinstance(e, dict) or not isinstance(e.get("action"), str):
                return "a trace entry without an action"
            if not all(_whole(e.get(k, 0), top) for k, top in limits.items()):
                what = repr(e["action"][:40])
                return f"an entry {what} whose addr, size, stream or time_us is not a whole number in range"
    for seg in segments:
        blocks = seg.get("blocks", [])
        if not _whole(seg.get("device", 0), 127) or not _whole(seg.get("address", 0) or 0, 1 << 64) \
                or not _whole(seg.get("total_size", 0) or 0, MAX_BLOCK_BYTES) or not isinstance(blocks, list):
            return "a segment whose device, address, total_size or blocks are not what a snapshot holds"
        if not all(isinstance(b, dict) and _whole(b.get("size", 0) or 0, MAX_BLOCK_BYTES)
                   and _whole(b.get("address", 0) or 0, 1 << 64) for b in blocks):
            return "a block whose size or address is not a whole number in range"
    return None


_ACTIONS = {"alloc": (Kind.ALLOC, 1), "free_completed": (Kind.FREE, -1), "segment_alloc": (Kind.SEGMENT_ALLOC, 1),
            "segment_free": (Kind.SEGMENT_FREE, -1), "segment_map": (Kind.SEGMENT_MAP, 1),
            "segment_unmap": (Kind.SEGMENT_UNMAP, -1), "oom": (Kind.OOM, 1)}


def _frame_name(frames: Any) -> str:
    """Where an allocation was made, from its frames: memprof's FX node, else the innermost frame
    outside torch's own files (Python frames come innermost first in a snapshot)."""
    if not isinstance(frames, list):
        return ""
    for f in frames:
        if isinstance(f, dict) and isinstance(f.get("fx_node_name"), str) and f["fx_node_name"]:
            return str(f["fx_node_name"])
    for f in frames:
        if not isinstance(f, dict):
            continue
        filename, name = str(f.get("filename", "")), str(f.get("name", ""))
        if filename.endswith(".py") and "/torch/" not in filename:
            return f"{name} ({os.path.basename(filename)}:{f.get('line', 0)})"
    return ""


def _category(entry: dict[str, Any]) -> str | None:
    c = entry.get("category")
    if not isinstance(c, str):
        return None
    c = _TORCH_CATEGORIES.get(c, c)
    return c if c in CATEGORIES and c != "unattributed" else None


def _known(entry: dict[str, Any], t_ns: int, device: str, addr: int, size: int, where: str) -> list[KnownTensor]:
    """The block's category as a known tensor, where the entry carries one (memprof's own node
    labels already lead with their category: it is not repeated)."""
    cat = _category(entry)
    return [KnownTensor(t_ns, device, addr, size, cat, where.removeprefix(f"{cat}:") or cat)] if cat else []


def to_parts(data: dict[str, Any], path: Path) -> Parts:
    """What a capture of a snapshot's traces holds: every allocation, free, segment and OOM entry as an event
    (in trace order; `time_us` as time), blocks live before the trace as the capture's start
    (those freed in it without an allocation in it, and those live at the end not allocated in
    it), categories where entries carry them, and the frames as each allocation's scope."""
    names = data.get(KEY, {}).get("devices", {}) if isinstance(data.get(KEY), dict) else {}
    strings: list[str] = [""]
    string_id: dict[str, int] = {"": 0}
    rows: list[tuple[int, int, int, int, int, int, int, int, int]] = []
    known: list[KnownTensor] = []
    meta: dict[str, Any] = {"baselines": {}, "preexisting": {}, "command": f"memory snapshot {path.name}",
                            "status": "completed", "first_in_process": False, "notes": [
                                "read from a memory snapshot: its trace is the allocator's ring of the last "
                                "entries, and blocks from before it count from its start"]}
    t_last = 0
    for index, trace in enumerate(data["device_traces"]):
        device = str(names.get(str(index), f"cuda:{index}"))
        try:
            dtype, dindex = parse_device(device)
        except ValueError:
            dtype, dindex = 1, index
            device = f"cuda:{index}"
        alive: dict[int, int] = {}
        before: dict[int, int] = {}
        seg_delta = 0
        # a CUDA caching allocator's snapshot (its segments say their type; torch.profiler's
        # `_profile_to_snapshot` makes one plain segment): its entries hold requests, its blocks are
        # rounded up to 512-byte granules (what memory_allocated and max_memory_allocated count)
        rounded = dtype == CUDA and any("segment_type" in seg for seg in data["segments"]
                                        if isinstance(seg, dict) and seg.get("device", 0) == index)
        for e in trace:
            action = _ACTIONS.get(e["action"])
            if action is None:
                continue
            kind, sign = action
            addr, size = int(e.get("addr", 0)), int(e.get("size", 0))
            t_last = max(t_last + 1, int(e.get("time_us", 0)) * 1000)
            where = _frame_name(e.get("frames"))
            if where not in string_id:
                string_id[where] = len(strings)
                strings.append(where)
            if kind == Kind.OOM:
                rows.append((t_last, size, 0, int(e.get("stream", 0)), addr, string_id[where], kind, dtype, dindex))
                continue
            requested = size
            if kind == Kind.ALLOC:
                size = round_size(size) if rounded else size
                alive[addr] = size
                known.extend(_known(e, t_last, device, addr, size, where))
            elif kind == Kind.FREE:
                freed = alive.pop(addr, None)
                size = freed if freed is not None else (round_size(size) if rounded else size)
                if freed is None:
                    before[addr] = size  # allocated before the trace began
                    known.extend(_known(e, 0, device, addr, size, where))
            else:
                seg_delta += sign * size
            rows.append((t_last, sign * size, addr, int(e.get("stream", 0)), requested if kind == Kind.ALLOC else -1,
                         string_id[where], kind, dtype, dindex))
        end_blocks, reserved_end = _segment_state(data["segments"], index)
        whole = [b for _a, size, b in end_blocks
                 if rounded and size > round_size(int(b.get("requested_size") or size))]
        if whole and UNSPLIT_NOTE not in meta["notes"]:
            meta["notes"].append(UNSPLIT_NOTE)
        for addr, size, block in end_blocks:
            if addr not in alive and addr not in before:
                before[addr] = size  # live through the whole trace
                known.extend(_known(block, 0, device, addr, size, _frame_name(block.get("frames"))))
        if trace or end_blocks:
            meta["preexisting"][device] = [[a, s] for a, s in sorted(before.items())]
            meta["baselines"][device] = {"allocated": sum(before.values()),
                                         "reserved": max(0, reserved_end - seg_delta)}
    raw = np.zeros(len(rows), dtype=EVENT_DTYPE)
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    for j, i in enumerate(order):
        raw[j] = (*rows[i][:6], 0, *rows[i][6:], 0)  # (thread 0, flags 0)
    if len(raw):
        meta["t_start_ns"], meta["t_stop_ns"] = int(raw["t_ns"][0]), int(raw["t_ns"][-1])
    meta["cuda_tracker"] = "attached" if any(d != "cpu" for d in meta["baselines"]) else None
    return Parts(Events.of(raw), strings, meta, [], [], [], known, [])


def _segment_state(segments: list[dict[str, Any]], index: int) -> tuple[list[tuple[int, int, dict[str, Any]]], int]:
    """The active blocks (address, size, block) and reserved bytes of a device's segments at the end."""
    blocks: list[tuple[int, int, dict[str, Any]]] = []
    reserved = 0
    for seg in segments:
        if seg.get("device", 0) != index:
            continue
        addr = seg.get("address", 0)
        reserved += int(seg.get("total_size", 0) or 0)
        for b in seg.get("blocks", []) or []:
            if not isinstance(b, dict):
                continue
            size = int(b.get("size", 0) or 0)
            at = int(b.get("address", addr) or addr)
            if str(b.get("state", "")).startswith("active"):
                blocks.append((at, size, b))
            addr = at + size
    return blocks, reserved


def load(path: Path) -> Parts:
    """A snapshot file read as a capture's parts (`memprof.load` calls this for pickles)."""
    return to_parts(read(path), path)
