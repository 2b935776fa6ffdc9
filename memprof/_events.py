"""The event record shared by the native core, the file format and the analysis.

`EVENT_DTYPE` mirrors `memprof::Event` in csrc/events.h byte for byte; the native
module exports its offsets and `memprof._native` checks them at import.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import NamedTuple

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
