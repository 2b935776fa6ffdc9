"""What the remat pass did to one forward/backward pair (plain data, stored in compile plans)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memprof.analysis.units import fmt_mb


@dataclass
class RematReport:
    mode: str
    status: str = "unchanged"  # applied | unchanged | fallback
    seconds: float = 0.0  # time the pass added to this compile (its own work)
    partition_seconds: float = 0.0  # time of the partitioner it wraps (stock work)
    # saved-set choice (estimates in bytes, from memprof's liveness walk of the simulated programs)
    start_budget: float | None = None  # another budget whose stock saved set the chosen one grew from
    ladder_tried: int = 0  # other budgets' stock saved sets tried as starting points
    ladder_budgets: list[float] = field(default_factory=list)  # those budgets, in the order tried
    stock_estimate: int | None = None  # stock plan: max(forward, backward) peak
    saves_estimate: int | None = None  # after the saved-set choice
    fw_estimate: int | None = None
    junction_estimate: int | None = None  # saved + outputs + their gradients (between forward and backward)
    saved_added: list[str] = field(default_factory=list)  # layer-boundary values now saved
    random_saved: list[str] = field(default_factory=list)  # saved so that no random op is recomputed
    random_saved_bytes: int = 0  # what saving them costs (Inductor's seeds: bytes; else dropout masks)
    masks_saved: list[str] = field(default_factory=list)  # attention masks saved so Inductor keeps them broadcast
    stock_random_recomputed: int | None = None  # random ops the stock plan's backward would redraw
    stock_saved_bytes: int | None = None
    saved_bytes: int | None = None
    stock_recompute_cost: float | None = None  # FLOPs (matmuls, attention) + elements (other ops) recomputed
    recompute_cost: float | None = None
    step_work: float | None = None  # the step's work without recomputation, in the same units
    save_seconds: float = 0.0
    # use-site edits on the partitioned backward
    bw_estimate_before: int | None = None
    bw_estimate_after: int | None = None
    usesite_edits: int = 0
    usesite_seconds: float = 0.0
    usesite_stopped: str = ""
    usesite_added_cost: float = 0.0
    random_before: int | None = None  # random ops in the backward, before and after the pass
    random_after: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def estimate_before(self) -> int | None:
        return self.stock_estimate if self.stock_estimate is not None else self.bw_estimate_before

    @property
    def estimate_after(self) -> int | None:
        parts = [p for p in (self.fw_estimate, self.junction_estimate, self.bw_estimate_after) if p is not None]
        if self.stock_estimate is not None and self.fw_estimate is None and self.saves_estimate is not None:
            parts.append(self.saves_estimate)
        return max(parts) if parts else None

    @property
    def estimated_bytes_saved(self) -> int | None:
        before, after = self.estimate_before, self.estimate_after
        return None if before is None or after is None else before - after

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["estimated_bytes_saved"] = self.estimated_bytes_saved
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RematReport:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})

    def _extra_work(self) -> str:
        """What the chosen set recomputes beyond the stock plan, as a share of the step's work."""
        if not self.step_work or self.recompute_cost is None or self.stock_recompute_cost is None:
            return ""
        extra = self.recompute_cost - self.stock_recompute_cost
        return f" (+{extra / self.step_work:.1%} of the step's work recomputed)" if extra > 0 else ""

    def summary(self) -> str:
        """One line on what the pass did (`memprof report` prints it under the plan)."""
        parts = [f"remat {self.mode}: {self.status}"]
        if self.start_budget is not None:
            parts.append(f"started from budget {self.start_budget:g}'s saved set{self._extra_work()}")
        if self.saved_added:
            parts.append(f"{len(self.saved_added)} layer boundaries saved")
        if self.random_saved:
            parts.append(f"{len(self.random_saved)} random values saved instead of redrawn "
                         f"({fmt_mb(self.random_saved_bytes)} MB)")
        if self.masks_saved:
            parts.append(f"{len(self.masks_saved)} attention masks saved (kept broadcast)")
        parts.append(f"{self.usesite_edits} use-site edits")
        before, after = self.estimate_before, self.estimate_after
        if self.status != "applied" and before:  # the stock plan: one figure (two walks could differ)
            parts.append(f"its FX-graph estimate of this pair's peak {fmt_mb(before)} MB")
        elif before and after is not None:
            # the pass decides on the FX graphs, before Inductor fuses them: its figure is this
            # pair's peak as it judges plans, not the step peak (the summary prints that one)
            parts.append(f"its FX-graph estimate of this pair's peak {fmt_mb(before)} -> {fmt_mb(after)} MB")
        parts.append(f"{self.seconds:.2f} s")
        return "; ".join([", ".join(parts), *self.notes])
