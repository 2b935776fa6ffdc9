"""The constants Python keeps copies of (event layout, kinds, flags, scope bits) agree with the
native core's own, exported from C++."""

from __future__ import annotations

from memprof._events import EVENT_DTYPE, FLAG_CARRIED, FLAG_OTHER_THREAD, FLAG_UNFOLLOWED_THREAD, Kind
from memprof._native import native
from memprof.recorder import SCOPE_BITS


def test_event_kinds_and_scope_bits_match_the_core() -> None:
    constants = native().constants()
    assert constants["kinds"] == {k.name: int(k) for k in Kind}
    bits = constants["scope_bits"]
    assert {"ops": bits["function"] | bits["backward"] | bits["user"], "graphs": bits["user"],
                          "none": 0} == SCOPE_BITS


def test_event_layout_and_flags_match_the_core() -> None:
    layout = native().event_layout()
    flags = {"unfollowed_thread": FLAG_UNFOLLOWED_THREAD, "other_thread": FLAG_OTHER_THREAD, "carried": FLAG_CARRIED}
    assert layout.pop("flags_values") == flags
    assert layout.pop("itemsize") == EVENT_DTYPE.itemsize
    fields = EVENT_DTYPE.fields
    assert fields is not None and set(layout) == set(fields)
    for name, (offset, size) in layout.items():
        assert (fields[name][1], fields[name][0].itemsize) == (offset, size), name
