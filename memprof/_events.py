"""The event record shared by the native core, the file format and the analysis.

`EVENT_DTYPE` mirrors `memprof::Event` in csrc/events.h byte for byte; the native
module exports its offsets and `memprof._native` checks them at import.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from typing import NamedTuple, overload

import numpy as np

EVENT_FIELDS: tuple[tuple[str, str, int], ...] = (
    ("t_ns", "<i8", 0),
    ("bytes", "<i8", 8),
    ("ptr", "<u8", 16),
    ("stream", "<u8", 24),
    ("aux", "<i8", 32),
    ("scope", "<u4", 40),
    ("thread", "<u2", 44),
    ("kind", "u1", 46),
    ("device_type", "i1", 47),
    ("device_index", "i1", 48),
    ("flags", "u1", 49),
)
EVENT_ITEMSIZE = 56
EVENT_DTYPE = np.dtype(
    {
        "names": [f[0] for f in EVENT_FIELDS],
        "formats": [f[1] for f in EVENT_FIELDS],
        "offsets": [f[2] for f in EVENT_FIELDS],
        "itemsize": EVENT_ITEMSIZE,
    }
)
EVENT_NAMES: tuple[str, ...] = tuple(f[0] for f in EVENT_FIELDS)


def huge_pages(enabled: bool) -> bool:
    """Sets whether numpy asks the kernel to back its large arrays with huge pages; returns the
    previous setting. numpy does by default, and where the kernel then compacts memory at an
    array's first touch (transparent_hugepage/defrag `madvise`, a usual default), filling a fresh
    column of millions of events is several times slower (docs/benchmarks.md, session 29). The
    analysis makes its columns once and reads them a few times: small pages serve it better.
    memprof's own commands turn huge pages off; a traced script runs with numpy's default."""
    core = getattr(np, "_core", None) or np.core  # (numpy 1.x: np.core)
    setting = getattr(core.multiarray, "_set_madvise_hugepage", None)
    return bool(setting(enabled)) if setting is not None else False


class Kind(enum.IntEnum):
    """Event kinds (csrc/events.h `EventKind`)."""

    ALLOC = 0
    FREE = 1
    SCOPE_BEGIN = 2
    SCOPE_END = 3
    STEP = 4
    CUDA_ALLOC = 5  # allocation seen only by the CUDA tracker (thread memprof does not follow)
    CUDA_FREE_REQUESTED = 6  # free seen only by the CUDA tracker
    CUDA_FREE_COMPLETED = 7
    SEGMENT_ALLOC = 8
    SEGMENT_FREE = 9
    SEGMENT_MAP = 10
    SEGMENT_UNMAP = 11
    OOM = 12
    MARK = 13


KIND_NAMES = {k.value: k.name.lower() for k in Kind}
FLAG_UNFOLLOWED_THREAD = 1  # csrc/events.h kFlagUnfollowedThread
FLAG_OTHER_THREAD = 2  # kFlagOtherThread: a CPU event on a thread memprof's reporter does not follow
# kFlagCarried: carried into a step window or the ring of the last steps from before it (a block live
# there, a free of a block from before the capture, a device's reserved bytes so far)
FLAG_CARRIED = 4
# the flags by the names the native core exports them under (event_layout()["flags_values"])
FLAGS = {"unfollowed_thread": FLAG_UNFOLLOWED_THREAD, "other_thread": FLAG_OTHER_THREAD, "carried": FLAG_CARRIED}


class CarriedBlock(NamedTuple):
    """Where a block carried into a step window or a ring was allocated (csrc/events.h
    `CarriedContext`): the scopes open around its allocation on its thread, outermost first, each as
    (scope id, occurrence among its parent's children of that id), and its ordinal among the
    allocations made directly in the innermost of them. `row` is its allocation event's row."""

    row: int
    path: tuple[tuple[int, int], ...]
    ordinal: int

    @staticmethod
    def from_native(entries: list[tuple[int, list[tuple[int, int]], int]], first_row: int = 0) -> list[CarriedBlock]:
        return [CarriedBlock(first_row + int(i), tuple((int(s), int(o)) for s, o in path), int(n))
                for i, path, n in entries]

    def to_json(self) -> list[object]:
        return [self.row, [list(p) for p in self.path], self.ordinal]


class Events:
    """A capture's events as columns: one array per field of `EVENT_DTYPE`, all of one length, read
    as `events["kind"]`. A field that holds one value in every event (a CPU capture's stream, a
    single thread) is stored once, as a read-only view of that value, where the 56-byte records
    held it in every row: a 10 M-event capture's columns take what its varying fields need, not
    560 MB (`EventsBuilder`, which `memprof.fileformat` reads a file's events into). Rows select
    as in numpy: a slice, a mask or an index array gives the `Events` of those rows; one row is a
    record. The columns are never written (the analysis only reads the events)."""

    __slots__ = ("_columns", "_n")

    def __init__(self, columns: dict[str, np.ndarray], n: int) -> None:
        self._columns, self._n = columns, n

    @classmethod
    def of(cls, records: np.ndarray | Events) -> Events:
        """Views of an event array's fields (no copy; `EVENT_DTYPE`'s fields, in any layout), or
        the events themselves."""
        if isinstance(records, Events):
            return records
        if records.dtype.names != EVENT_NAMES or records.ndim != 1:
            raise ValueError(f"not an event array: {records.dtype} of shape {records.shape}")
        return cls({name: records[name].astype(EVENT_DTYPE[name], copy=False) for name in EVENT_NAMES}, len(records))

    @classmethod
    def from_chunks(cls, n: int, chunks: Iterable[np.ndarray]) -> Events:
        """The columns of `n` events given as `EVENT_DTYPE` arrays in order (a spill's chunks)."""
        builder = EventsBuilder(n)
        for chunk in chunks:
            builder.add(chunk)
        return builder.finish()

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, key: str) -> np.ndarray: ...

    @overload
    def __getitem__(self, key: int) -> np.void: ...

    @overload
    def __getitem__(self, key: slice | np.ndarray | list[int]) -> Events: ...

    def __getitem__(self, key: str | int | slice | np.ndarray | list[int]) -> np.ndarray | np.void | Events:
        if isinstance(key, str):
            return self._columns[key]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self._n if key < 0 else 0)
            if not 0 <= i < self._n:
                raise IndexError(f"event {int(key)} of {self._n}")
            row: np.void = self.records(i, i + 1)[0]
            return row
        columns = {name: col[key] for name, col in self._columns.items()}
        return Events(columns, len(columns["kind"]))

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        """The events as one `EVENT_DTYPE` array (a copy: `np.asarray(capture.raw)`)."""
        return self.records() if dtype is None else self.records().astype(dtype)

    def records(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) as `EVENT_DTYPE` records (a copy: what the file and the spill hold)."""
        stop = self._n if stop is None else min(stop, self._n)
        out = np.zeros(max(stop - start, 0), dtype=EVENT_DTYPE)
        for name, col in self._columns.items():
            out[name] = col[start:stop]
        return out

    def chunks(self, rows: int = 1 << 16) -> Iterator[np.ndarray]:
        """The events as records, `rows` at a time (saving writes these; never one copy of them all)."""
        for start in range(0, self._n, rows):
            yield self.records(start, start + rows)

    @property
    def nbytes(self) -> int:
        """The bytes the columns hold (a field stored once counts its one value)."""
        return sum(col.itemsize if col.strides == (0,) else col.nbytes for col in self._columns.values())


# Fields stored narrower while every value fits: a capture's sizes are almost all below 2 GiB and
# its strings (the scope ids) fewer than 65,536; at 10 M events the wide columns would hold 60 MB
# more than the analysis needs.
NARROW: dict[str, type[np.integer]] = {"bytes": np.int32, "aux": np.int32, "scope": np.uint16}


def _fits(col: np.ndarray, dtype: type[np.integer]) -> bool:
    info = np.iinfo(dtype)
    return bool(info.min <= int(col.min()) and int(col.max()) <= info.max)


def ids_for(column: np.ndarray, ids: Iterable[int]) -> np.ndarray:
    """`ids` (scope ids) in `column`'s dtype, to compare with it: those it cannot hold dropped (no
    event has them), never wrapped around onto another id."""
    top = np.iinfo(column.dtype).max
    return np.asarray([int(i) for i in ids if 0 <= int(i) <= top], dtype=column.dtype)


class EventsBuilder:
    """Builds the `Events` of `n` records given a chunk at a time, in order: a field keeps one stored
    value until a chunk holds another, and only then gets its column (the rows before filled with
    that value). A field of `NARROW` is stored in its narrower type while every value fits (widened
    once, when one does not). What is held while building is the varying columns and the chunk in
    hand. Readers take a column's values, never its dtype, from `EVENT_DTYPE`."""

    # Records taken a slice at a time: each field is a pass over the records' memory, and a slice this
    # size (896 KiB) stays in a core's cache for all of them (docs/benchmarks.md, session 33).
    SLICE = 16_384

    def __init__(self, n: int) -> None:
        self._n, self._at = n, 0
        self._value: dict[str, np.ndarray] = {}  # fields with one value so far
        self._full: dict[str, np.ndarray] = {}

    def add(self, chunk: np.ndarray) -> None:
        k = len(chunk)
        if self._at + k > self._n:
            raise ValueError(f"{self._at + k:,} events given to a table of {self._n:,}")
        for start in range(0, k, self.SLICE):
            self._add(chunk[start : start + self.SLICE])

    def _add(self, chunk: np.ndarray) -> None:
        k = len(chunk)
        for name in EVENT_NAMES:
            col = chunk[name]
            full = self._full.get(name)
            if full is None:
                value = self._value.setdefault(name, col[:1].copy())
                if bool((col == value[0]).all()):
                    continue
                narrow = NARROW.get(name)
                dtype = narrow if narrow is not None and _fits(col, narrow) and _fits(value, narrow) else col.dtype
                full = self._full[name] = np.empty(self._n, dtype=dtype)
                full[: self._at] = value[0]
                del self._value[name]
            elif full.dtype != col.dtype and not _fits(col, full.dtype.type):
                full = self._full[name] = full.astype(col.dtype)  # (a size of 2 GiB or more)
            full[self._at : self._at + k] = col
        self._at += k

    def finish(self) -> Events:
        if self._at != self._n:
            raise ValueError(f"{self._at:,} events given to a table of {self._n:,}")
        columns: dict[str, np.ndarray] = {}
        for name in EVENT_NAMES:
            col = self._full.get(name)
            if col is None:
                one = self._value.get(name, np.zeros(1, dtype=EVENT_DTYPE[name]))
                col = np.broadcast_to(one[:1], (self._n,))  # (read-only, stride 0)
            col.flags.writeable = False
            columns[name] = col
        return Events(columns, self._n)


def index_dtype(n: int) -> type[np.signedinteger]:
    """Rows of a capture of `n` events, and positions among them: int32 below 2**31 (half the memory
    of numpy's int64 on a capture of millions of events), else int64."""
    return np.int32 if n < 2**31 - 1 else np.int64


SEGMENT_KINDS = (Kind.SEGMENT_ALLOC, Kind.SEGMENT_FREE, Kind.SEGMENT_MAP, Kind.SEGMENT_UNMAP)


def kind_mask(kinds: np.ndarray, wanted: Iterable[int]) -> np.ndarray:
    """Which of `kinds` (the uint8 `kind` column) are among `wanted`: one table lookup per event
    (np.isin sorts or hashes; on a capture of millions of events that was most of a report's time)."""
    table = np.zeros(256, dtype=bool)
    table[np.asarray(list(wanted), dtype=np.int64)] = True
    mask: np.ndarray = table[kinds]
    return mask

# c10::DeviceType values that memprof names; others print as "type<N>:<index>".
_DEVICE_TYPE_NAMES = {0: "cpu", 1: "cuda"}


def device_name(device_type: int, device_index: int) -> str:
    """The torch-style name of a device ("cpu", "cuda:0"); "" for events without a device."""
    if device_type < 0:
        return ""
    base = _DEVICE_TYPE_NAMES.get(device_type, f"type{device_type}")
    if base == "cpu":
        return "cpu"
    return f"{base}:{max(device_index, 0)}"


def parse_device(name: str) -> tuple[int, int]:
    """Inverse of `device_name` for the device names memprof writes."""
    if name == "cpu":
        return 0, -1
    base, _, index = name.partition(":")
    types = {v: k for k, v in _DEVICE_TYPE_NAMES.items()}
    if base in types and index.isdigit():
        return types[base], int(index)
    if base.startswith("type") and base[4:].isdigit() and index.isdigit():
        return int(base[4:]), int(index)
    raise ValueError(f"not a device name: {name!r} (expected 'cpu' or 'cuda:N')")
