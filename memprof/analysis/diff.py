"""What changed between two captures at a point: the live bytes of each, grouped the same way and
subtracted (pure; no I/O).

Each capture's attribution rows sum exactly to its live bytes at the point (`rows_at`), so the
differences of matched rows sum exactly to the difference of the two totals: no row is hidden
in a remainder that does not add up. Rows match by key: a category; an FX node as
`fw0:mm_3` (the compiled graph's role and number in compile order, and the node's name), which
names the same node in two runs of one script; a layer; a kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from memprof.analysis.attribution import BY, AttributionRow
from memprof.errors import MemprofError

if TYPE_CHECKING:
    from memprof.capture import Capture


@dataclass(frozen=True)
class DiffRow:
    key: str
    a_bytes: int
    b_bytes: int
    a_count: int
    b_count: int
    category: str  # the row's category in B (in A where B has no such row)

    @property
    def delta(self) -> int:
        return self.b_bytes - self.a_bytes


@dataclass(frozen=True)
class CaptureDiff:
    at: str
    device: str
    a_total: int  # live bytes at the point (at "peak": the peak)
    b_total: int
    rows: dict[str, list[DiffRow]]  # by grouping, largest change first

    @property
    def delta(self) -> int:
        return self.b_total - self.a_total

    @property
    def ratio(self) -> float | None:
        return self.b_total / self.a_total if self.a_total else None

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "device": self.device, "a_bytes": self.a_total, "b_bytes": self.b_total,
                "delta_bytes": self.delta,
                "by": {by: [{**asdict(r), "delta": r.delta} for r in rows] for by, rows in self.rows.items()}}


def diff_rows(a: Sequence[AttributionRow], b: Sequence[AttributionRow]) -> list[DiffRow]:
    """Rows of A and B matched by key, largest absolute change first (then by key); rows whose
    bytes did not change are kept (the sums stay exact either way)."""
    a_by = {r.key: r for r in a}
    b_by = {r.key: r for r in b}
    out = []
    for key in a_by.keys() | b_by.keys():
        ra, rb = a_by.get(key), b_by.get(key)
        out.append(DiffRow(key, ra.bytes if ra else 0, rb.bytes if rb else 0, ra.count if ra else 0,
                           rb.count if rb else 0, (rb or ra).category))  # type: ignore[union-attr]
    out.sort(key=lambda r: (-abs(r.delta), r.key))
    return out


def diff_attributions(a: Mapping[str, Sequence[AttributionRow]], b: Mapping[str, Sequence[AttributionRow]],
                      a_total: int, b_total: int, at: str, device: str) -> CaptureDiff:
    """The diff of two captures' attribution tables (by grouping, as `Capture.attribution` gives
    them at the same point); the totals are the live bytes there."""
    rows = {by: diff_rows(a[by], b[by]) for by in BY if by in a and by in b}
    for by, rs in rows.items():  # the invariant the report promises
        if sum(r.delta for r in rs) != b_total - a_total:
            raise AssertionError(f"diff rows by {by} do not sum to the difference of the totals")
    return CaptureDiff(at, device, a_total, b_total, rows)


def diff(a: Capture, b: Capture, at: str = "peak", device: str | None = None) -> CaptureDiff:
    """What changed from capture `a` to capture `b` at `at` ("peak" or "step:N") on one device
    (default: the device each capture peaked on, which must be the same), by category, FX node,
    layer and kernel; each grouping's rows sum exactly to `b`'s live bytes there minus `a`'s."""
    if device is None:
        if a.main_device != b.main_device:
            raise MemprofError(f"the captures are of different devices (A: {a.main_device}, B: {b.main_device}): "
                               "name the one to compare with --device")
        device = a.main_device
    for name, cap in (("A", a), ("B", b)):
        if device not in cap.devices:
            raise MemprofError(f"capture {name} has no allocations on {device} (devices: {', '.join(cap.devices)})")
        tl = cap.timeline(device)
        if not len(tl.rows) and not tl.peak:
            raise MemprofError(f"capture {name} recorded no allocations on {device}: nothing to compare")
    tables = []
    for cap in (a, b):
        tables.append({by: cap.attribution(at, by, device) for by in BY})
    totals = [sum(r.bytes for r in t["category"]) for t in tables]
    return diff_attributions(tables[0], tables[1], totals[0], totals[1], at, device)
