"""What `memprof fit` decides, as pure functions of its predictions and its verifying run: which
configuration to run, whether it fits, and what would close the gap when none does."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from memprof.analysis.held_outputs import ADVICE as HELD
from memprof.analysis.units import fmt_bytes
from memprof.analysis.zero_grads import ADVICE


@dataclass(frozen=True)
class Config:
    """What memprof can set: the partitioner's activation memory budget, and its remat pass."""

    budget: float
    remat: str | None = None  # None: stock; "light" or "all"

    @property
    def label(self) -> str:
        return f"budget {self.budget:g}" + (f" with --remat {self.remat}" if self.remat else " (stock)")

    def trace_options(self) -> list[str]:
        return ["--budget", f"{self.budget:g}", *(["--remat", self.remat] if self.remat else [])]

    def to_json(self) -> dict[str, float | str | None]:
        return {"budget": self.budget, "remat": self.remat}

    def python_lines(self) -> list[str]:
        lines = [f"torch._functorch.config.activation_memory_budget = {self.budget:g}"]
        if self.remat:
            lines.append(f'memprof.remat.enable("{self.remat}")  # before the first compile')
        return lines


@dataclass(frozen=True)
class Candidate:
    """One configuration as compile-time prediction saw it (no step ran)."""

    config: Config
    step_peak: int | None  # memprof's estimate of the step's peak above its resident bytes
    resident: int | None  # bytes a step starts from (parameters, data, the optimizers' state)
    recomputed_bytes: int | None = None
    random_ops_saved: bool = True  # False: the plan redraws a random op in the backward
    error: str | None = None
    reserved: int | None = None  # CUDA: the caching allocator's reserved bytes, from its model (often low)

    @property
    def peak(self) -> int | None:
        """The predicted peak of the process's allocated bytes on the device."""
        if self.step_peak is None or self.resident is None:
            return None
        return self.resident + self.step_peak

    @property
    def need(self) -> int | None:
        """The predicted bytes the limit applies to: reserved on CUDA where predicted (a block is
        reserved before it is allocated), else allocated."""
        peak = self.peak
        return None if peak is None else max(peak, self.reserved or 0)


def preference(c: Candidate) -> tuple[float, int, int]:
    """Least recomputation first: the highest budget (the partitioner recomputes less the more budget
    it has; the remat pass keeps the step time of stock at its budget), stock before the pass at one
    budget, then the fewest recomputed bytes."""
    return (-c.config.budget, 0 if c.config.remat is None else 1, c.recomputed_bytes or 0)


def fitting(candidates: Sequence[Candidate], limit: int) -> list[Candidate]:
    """The candidates predicted to fit under `limit` bytes, in order of preference (random ops
    redrawn in the backward are wrong gradients: those plans never fit)."""
    ok = [c for c in candidates if c.need is not None and c.need <= limit and c.random_ops_saved]
    return sorted(ok, key=preference)


def reserved_overhead(runs: Sequence[Measured]) -> int:
    """The most bytes the caching allocator reserved above the allocated peak in the runs so far that
    ended well (0 on the CPU, or before any run): what a configuration's allocated peak needs beside
    it under a limit on reserved bytes. (The allocator's model predicts reserved bytes too, but low
    where a real run reserves segments it never sees: the runs' overhead stands beside it.)"""
    return max((m.reserved_peak - m.peak for m in runs if m.error is None and m.reserved_peak is not None),
               default=0)


def next_to_verify(candidates: Sequence[Candidate], limit: int, runs: Sequence[Measured],
                   tried: Collection[Config]) -> Candidate | None:
    """The preferred configuration not `tried` yet that is predicted to fit with the reserved overhead
    the `runs` so far measured (`reserved_overhead`): a run over the limit in reserved bytes rules out
    the next ones that would be over by as much, so they are not run only to be refused."""
    room = limit - reserved_overhead(runs)
    return next((c for c in fitting(candidates, limit) if c.config not in tried and (c.peak or 0) <= room), None)


def smallest(candidates: Sequence[Candidate]) -> Candidate | None:
    known = [c for c in candidates if c.need is not None and c.random_ops_saved]
    return min(known, key=lambda c: (c.need or 0, preference(c))) if known else None


@dataclass(frozen=True)
class Measured:
    """The verifying run of one configuration (a `memprof trace` capture)."""

    config: Config
    peak: int  # the process's allocated peak on the device (`Capture.peak`)
    reserved_peak: int | None  # the caching allocator's reserved peak (CUDA)
    step_peak: int | None
    resident: int | None
    step_ms: float | None
    capture: str
    exact: bool = True
    error: str | None = None  # the run did not end well (out of memory, an exception): never within
    garbage: int = 0  # bytes live at the peak that Python's cyclic garbage collector freed later

    def within(self, limit: int) -> bool:
        """Whether the run ended well and stayed under the limit: its reserved bytes on CUDA (what
        the device gives out), its allocated bytes on the CPU."""
        return self.error is None and self.exact and max(self.peak, self.reserved_peak or 0) <= limit


@dataclass(frozen=True)
class Suggestion:
    what: str
    saves: int  # bytes it takes off the peak, by the capture's figures


def suggestions(gap: int, at_peak: Mapping[str, int], largest: Sequence[tuple[str, int]],
                reserved_slack: int, zero_grads: int = 0, held: tuple[int, Sequence[str]] = (0, ())
                ) -> list[Suggestion]:
    """What would close a `gap` of bytes, from the verifying run's capture of the smallest
    configuration: its bytes at the peak by category, its largest live allocations (name, bytes),
    reserved-but-unallocated bytes at the reserved peak, the zeros autograd made at the peak for
    compiled outputs no loss used (`memprof.analysis.zero_grads`) and the compiled outputs the script
    held there (bytes, FX nodes: `memprof.analysis.held_outputs`). Largest saving first."""
    out: list[Suggestion] = []
    if zero_grads:
        out.append(Suggestion(f"{fmt_bytes(zero_grads)} at the peak are {ADVICE}", zero_grads))
    if held[0]:
        nodes = ", ".join(held[1])
        out.append(Suggestion(f"{fmt_bytes(held[0])} at the peak are " + HELD.format(nodes=nodes), held[0]))
    state = at_peak.get("optimizer_state", 0)
    if state:
        out.append(Suggestion(f"the optimizer state is {fmt_bytes(state)} at the peak: an 8-bit optimizer "
                              "(bitsandbytes' AdamW8bit) holds about a quarter of it", state * 3 // 4))
        for ranks in (2, 4, 8, 16, 32, 64):
            if state - state // ranks >= gap:
                out.append(Suggestion(f"sharding the optimizer state over {ranks} ranks (ZeRO-1, FSDP) holds "
                                      f"{fmt_bytes(state // ranks)} of it per rank", state - state // ranks))
                break
    grads = at_peak.get("gradient", 0)
    params = at_peak.get("parameter", 0)
    if grads and params:
        out.append(Suggestion(f"parameters and gradients are {fmt_bytes(params + grads)}: FSDP over 2 ranks "
                              "shards both", (params + grads) // 2))
    for name, size in largest[:1]:
        out.append(Suggestion(f"the largest tensor live at the peak is {name} ({fmt_bytes(size)}): it scales "
                              "with the batch (halving the batch takes about half of it off)", size // 2))
    if reserved_slack >= max(gap // 4, 1):
        out.append(Suggestion(f"the caching allocator reserved {fmt_bytes(reserved_slack)} it had not allocated "
                              "at its reserved peak: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True gives "
                              "most of it back", reserved_slack))
    return sorted(out, key=lambda s: -s.saves)


@dataclass
class FitResult:
    """What `memprof fit` found: the limit, every prediction, the runs that verified one, its choice."""

    limit: int
    device: str
    candidates: list[Candidate]
    verified: list[Measured] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # verifying runs that left no figures, and why
    choice: Measured | None = None  # the preferred configuration whose run stayed under the limit
    suggestions: list[Suggestion] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # the script and its arguments
    parameter_bytes: int | None = None  # the model's parameters on the device (from the search)
    compiled: bool = True  # False: the script compiles no graph with a backward; its run as it is was measured

    @property
    def fits(self) -> bool:
        return self.choice is not None

    def candidate(self, config: Config) -> Candidate | None:
        return next((c for c in self.candidates if c.config == config), None)


def others(r: FitResult) -> list[tuple[str, int]]:
    """What the usual answers would have said for this job, beside memprof's: a parameter-count
    formula (Hugging Face accelerate's `estimate-memory` for training with Adam: four times the
    parameters' bytes, no activations) and torch's default (activation_memory_budget 1.0, stock)."""
    out = []
    if r.parameter_bytes:
        out.append(("parameters x 4 (accelerate estimate-memory, Adam training)", 4 * r.parameter_bytes))
    default = r.candidate(Config(1.0))
    if default is not None and default.peak is not None:
        out.append(("torch's default budget (1.0, stock), predicted", default.peak))
    return out
