"""Loads the native core, memprof._C, with a one-line error that says how to build it."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from memprof._events import EVENT_DTYPE, EVENT_ITEMSIZE, FLAG_OTHER_THREAD, FLAG_UNFOLLOWED_THREAD
from memprof.errors import NativeUnavailable

BUILD_HINT = "build it with: pip install --no-build-isolation -e .  (torch must be installed first)"


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
    if flags != {"unfollowed_thread": FLAG_UNFOLLOWED_THREAD, "other_thread": FLAG_OTHER_THREAD}:
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
