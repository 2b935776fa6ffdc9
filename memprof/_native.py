"""Loads the native core, memprof._C, with a one-line error that says how to build it."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import numpy as np

from memprof._events import EVENT_DTYPE, EVENT_ITEMSIZE, FLAGS, CarriedBlock
from memprof.errors import NativeUnavailable

BUILD_HINT = ("build it with: bash tools/setup.sh (in a checkout of memprof), or by hand: "
              "pip install --no-build-isolation -e .  (torch installed first)")


@functools.cache
def native() -> ModuleType:
    """The native module, checked against the Python event layout."""
    try:
        import torch  # noqa: F401  (loads libtorch before the extension)

        _C = importlib.import_module("memprof._C")
    except ImportError as exc:
        raise NativeUnavailable(f"memprof's native extension is not available ({exc}); {BUILD_HINT}") from None
    layout = _C.event_layout()
    flags = layout.pop("flags_values", None)
    if flags != FLAGS:
        raise NativeUnavailable(f"memprof._C event flags do not match this memprof; rebuild it: {BUILD_HINT}")
    if layout.pop("itemsize") != EVENT_ITEMSIZE:
        raise NativeUnavailable(f"memprof._C event layout does not match this memprof; rebuild it: {BUILD_HINT}")
    fields = EVENT_DTYPE.fields
    assert fields is not None
    for name, (offset, size) in layout.items():
        field = fields[name]
        if field[1] != offset or field[0].itemsize != size:
            raise NativeUnavailable(f"memprof._C field {name!r} does not match this memprof; {BUILD_HINT}")
    return _C


def thread_table() -> list[dict[str, object]]:
    """The threads that produced events, as threads.json stores them: index, OS thread id, name."""
    return [{"index": i, "tid": tid, "name": name} for i, tid, name in native().threads()]


def ring_events() -> tuple[np.ndarray, list[CarriedBlock]]:
    """The events of a ring of the last steps (a capture with keep_last): those carried into it (the
    blocks live at its start), then its own; empty when the store holds no ring. With them, where the
    carried blocks were allocated."""
    C = native()
    start, carried, context = C.ring_head()
    head = np.asarray(carried).view(EVENT_DTYPE)
    count = int(C.event_count()) - int(start)
    tail = np.asarray(C.events_range(start, count)).view(EVENT_DTYPE) if count > 0 else head[:0]
    if len(tail) != max(count, 0):
        raise RuntimeError("the ring moved while it was read")
    out = np.empty(len(head) + len(tail), dtype=EVENT_DTYPE)  # (concatenate would drop the padding)
    out[: len(head)], out[len(head):] = head, tail
    return out, CarriedBlock.from_native(context)
