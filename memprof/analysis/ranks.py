"""The ranks of one distributed run side by side: each rank's peak, when, in which step and phase,
and with what; which rank peaks highest and the spread between ranks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memprof.analysis.attribution import BACKWARD_SCOPES, OPTIMIZER_SCOPES
from memprof.analysis.distributed import DISTRIBUTED
from memprof.analysis.labels import CATEGORIES
from memprof.capture import Capture


@dataclass(frozen=True)
class RankRow:
    rank: int
    device: str
    peak: int
    exact: bool
    at_s: float  # seconds after the rank's capture started
    step: int | None  # the step the peak is in
    phase: str  # "forward", "backward", "optimizer" or "" (outside them)
    top: list[tuple[str, int]]  # the largest categories live at the peak
    distributed: list[tuple[str, int]]  # FSDP2's and DDP's categories live at the peak (analysis.distributed)
    status: str | None  # how the rank's run ended
    error: str | None  # why, when it ended by an error


@dataclass(frozen=True)
class RankSet:
    world_size: int
    backend: str | None
    rows: list[RankRow]

    @property
    def highest(self) -> RankRow:
        return max(self.rows, key=lambda r: (r.peak, -r.rank))

    @property
    def lowest(self) -> RankRow:
        return min(self.rows, key=lambda r: (r.peak, r.rank))

    @property
    def spread(self) -> int:
        """The highest peak minus the lowest."""
        return self.highest.peak - self.lowest.peak


_DISTRIBUTED = frozenset(CATEGORIES[c] for c in DISTRIBUTED)


def phase_of(stack: list[str]) -> str:
    """The training phase a scope stack is in (outermost first)."""
    if any(s.startswith(OPTIMIZER_SCOPES) for s in stack):
        return "optimizer"
    if any(s.startswith(BACKWARD_SCOPES) for s in stack):
        return "backward"
    return "forward" if stack else ""


def _row(rank: int, cap: Capture) -> RankRow:
    dev = cap.main_device
    tl = cap.timeline(dev)
    pos = tl.peak_pos
    row = int(tl.rows[pos]) if pos >= 0 else -1
    step = next((s.step for s in cap.steps(dev) if s.start_row <= row < s.end_row), None) if row >= 0 else None
    rows = cap.attribution(at="peak", by="category", device=dev, lower_bound=True)
    at = (int(tl.t_ns[pos]) - cap.info.t_start_ns) / 1e9 if pos >= 0 else 0.0
    return RankRow(rank=rank, device=dev, peak=tl.peak, exact=cap.exact, at_s=at, step=step,
                   phase=phase_of(cap.scope_stack_at_peak(dev)), top=[(r.key, r.bytes) for r in rows[:3]],
                   distributed=[(r.key, r.bytes) for r in rows if r.key in _DISTRIBUTED and r.bytes],
                   status=cap.info.status, error=error if isinstance(error := cap.meta.get("error"), str) else None)


def rank_set(caps: Mapping[int, Capture], world_size: int) -> RankSet:
    backends = {c.info.backend for c in caps.values()} - {None}
    return RankSet(world_size, backends.pop() if len(backends) == 1 else None,
                   [_row(r, c) for r, c in sorted(caps.items())])
