"""A sweep's results as plain data (`sweep.json`), and the analysis over them (pure)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memprof.analysis.units import MB, fmt_mb
from memprof.errors import MemprofError
from memprof.outputs import json_text
from memprof.sweep.detect import (
    ABS_TOL,
    REL_TOL,
    Flag,
    auto_floor,
    non_monotone,
    spearman,
    tolerance,
    worst_per_budget,
)
from memprof.sweep.measure import KNAPSACK, OP_CLASSES, Measured, PlanFacts

FORMAT = 1


@dataclass
class Run:
    """One budget in one variant ("stock", or a remat mode), measured in its own process."""

    variant: str
    budget: float
    status: str  # completed | exit | exception | oom | interrupted | crashed | timeout
    exit_code: int | None
    error: str | None
    capture: str | None  # file name inside the sweep directory
    log: str
    wall_s: float
    measured: Measured | None = None
    # a torchrun job (--nproc): each rank's step peak; `measured` and `capture` are the highest rank's
    rank_peaks: list[int | None] | None = None

    @property
    def highest_rank(self) -> int | None:
        return highest_rank(self.rank_peaks or [])

    @property
    def rank_spread(self) -> int | None:
        """The highest rank's step peak minus the lowest's."""
        peaks = [p for p in self.rank_peaks or [] if p is not None]
        return max(peaks) - min(peaks) if len(peaks) >= 2 else None

    @property
    def ok(self) -> bool:
        return self.measured is not None and self.status in ("completed", "exit") and self.exit_code == 0

    @property
    def step_peak(self) -> int | None:
        return None if not self.ok or self.measured is None else self.measured.step_peak

    @property
    def facts(self) -> PlanFacts | None:
        return self.measured.facts if self.measured is not None else None

    @staticmethod
    def from_json(d: dict[str, Any]) -> Run:
        m = d.get("measured")
        return Run(**{**d, "measured": Measured.from_json(m) if isinstance(m, dict) else None})


def highest_rank(peaks: list[int | None]) -> int | None:
    """The rank with the highest step peak, the lowest rank on a tie; None when no rank has one."""
    known = [(p, -r) for r, p in enumerate(peaks) if p is not None]
    return -max(known)[1] if known else None


def run_estimate(run: Run | None, name: str) -> float | None:
    """One estimator's predicted step peak for a run (bytes; KnapsackEvaluator: normalized units)."""
    return None if run is None or run.measured is None else run.measured.estimates.get(name)


def run_value(run: Run, mode: str) -> int | None:
    """A run's point on the curve: its measured step peak ("measure"), or memprof's estimate ("predict")."""
    if mode == "measure":
        return run.step_peak
    if not run.ok:
        return None
    est = run_estimate(run, "memprof")
    return None if est is None else int(est)


@dataclass
class Diagnosis:
    """Why `flag.low` peaks above `flag.high`: selection and lifetime, from the two captures."""

    variant: str
    low: float
    high: float
    low_peak: int
    high_peak: int
    lines: list[str]


@dataclass
class Sweep:
    command: list[str]
    budgets: list[float]
    variants: list[str]
    runs: list[Run]
    # abs_bytes None: `auto_floor` of the sweep's own peaks (`abs_tol`)
    noise: dict[str, float | None] = field(default_factory=lambda: {"abs_bytes": None, "rel": REL_TOL})
    notes: list[str] = field(default_factory=list)
    mode: str = "measure"  # "measure": step peaks from captures; "predict": memprof's compile-time estimate
    nproc: int = 1  # processes per budget (a torchrun job each when above 1)
    format: int = FORMAT

    def value(self, run: Run) -> int | None:
        """The curve's value at one run: the measured step peak, or (predict) memprof's estimate."""
        return run_value(run, self.mode)

    def runs_of(self, variant: str) -> list[Run]:
        return sorted((r for r in self.runs if r.variant == variant), key=lambda r: r.budget)

    def abs_tol(self) -> int:
        """The absolute noise floor in bytes: the user's, or scaled to the sweep's peaks."""
        given = self.noise.get("abs_bytes")
        return int(given) if given is not None else auto_floor([self.value(r) for r in self.runs])

    def rel_tol(self) -> float:
        return float(self.noise.get("rel") or 0.0)

    def flags(self, variant: str = "stock") -> list[Flag]:
        return non_monotone([(r.budget, self.value(r)) for r in self.runs_of(variant)], self.abs_tol(), self.rel_tol())

    def floor_hides(self, variant: str = "stock") -> bool:
        """Whether the noise floor exceeds every difference between the variant's peaks (nothing
        could be flagged, whatever the curve)."""
        peaks = [p for r in self.runs_of(variant) if (p := self.value(r))]
        return len(peaks) >= 2 and max(peaks) - min(peaks) <= tolerance(min(peaks), self.abs_tol(), self.rel_tol())

    def diagnoses(self, variant: str = "stock") -> list[Diagnosis]:
        by_budget = {r.budget: r for r in self.runs_of(variant)}
        worst = worst_per_budget(self.flags(variant))
        return [diagnose(variant, f, by_budget[f.low], by_budget[f.high]) for f in worst]

    def random_recompute(self, variant: str = "stock") -> list[tuple[float, int]]:
        """Budgets whose plans make the backward redraw random ops, with the count."""
        out = []
        for r in self.runs_of(variant):
            f = r.facts
            if f is not None and f.recomputed_random:
                out.append((r.budget, len(f.recomputed_random)))
        return out

    def estimator_scores(self, variant: str = "stock") -> dict[str, dict[str, float | int | None]]:
        """Each compile-time estimator against the measured step peaks: Spearman's rank correlation,
        median and largest relative error, over the budgets where both exist."""
        out: dict[str, dict[str, float | int | None]] = {}
        runs = [r for r in self.runs_of(variant) if r.step_peak] if self.mode == "measure" else []
        names = sorted({k for r in runs if r.measured is not None for k in r.measured.estimates})
        for name in names:
            pairs = [(float(e), float(r.step_peak)) for r in runs
                     if r.step_peak and (e := run_estimate(r, name)) is not None]
            errs = [] if name == KNAPSACK else [abs(e - m) / m for e, m in pairs]
            out[name] = {"budgets": len(pairs), "spearman": spearman([e for e, _ in pairs], [m for _, m in pairs]),
                         "median_error": statistics.median(errs) if errs else None,
                         "max_error": max(errs) if errs else None}
        return out

    def same_estimates(self, variant: str, a: str, b: str) -> bool:
        """Whether two estimators gave the same figure at every budget of the variant."""
        return all(run_estimate(r, a) == run_estimate(r, b) for r in self.runs_of(variant))

    def never_compiled(self) -> bool:
        done = [r for r in self.runs if r.ok]
        return bool(done) and not any(r.measured is not None and r.measured.compiled for r in done)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["analysis"] = {
            v: {
                "flags": [asdict(f) | {"excess": f.excess} for f in self.flags(v)],
                "diagnoses": [asdict(x) for x in self.diagnoses(v)],
                "random_recompute": [{"budget": b, "random_ops": n} for b, n in self.random_recompute(v)],
                "estimators": self.estimator_scores(v),
            }
            for v in self.variants
        }
        return d

    def save(self, directory: Path) -> Path:
        path = directory / "sweep.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json_text(self.to_json(), indent=1))
        tmp.replace(path)
        return path


def load_sweep(path: str | Path) -> Sweep:
    p = Path(path)
    if p.is_dir():
        p = p / "sweep.json"
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise MemprofError(f"{p} does not exist") from None
    except (OSError, ValueError) as exc:
        raise MemprofError(f"{p} is not a sweep.json ({exc})") from None
    if not isinstance(d, dict) or int(d.get("format", 0)) > FORMAT:
        raise MemprofError(f"{p}: unknown sweep format (this memprof reads format {FORMAT})")
    noise = dict(d.get("noise", {})) or {"abs_bytes": ABS_TOL, "rel": REL_TOL}  # before the floor was scaled
    return Sweep(command=list(d["command"]), budgets=[float(b) for b in d["budgets"]], variants=list(d["variants"]),
                 runs=[Run.from_json(r) for r in d["runs"]], noise=noise, notes=list(d.get("notes", [])),
                 mode=str(d.get("mode", "measure")), nproc=int(d.get("nproc", 1)))


def _classes(d: dict[str, int], top: int = 4) -> str:
    items = sorted(((c, b) for c, b in d.items() if b), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{c} {b / MB:.1f}" for c, b in items) or "nothing"


def diagnose(variant: str, flag: Flag, low: Run, high: Run) -> Diagnosis:
    """Selection (what each plan saved and recomputed, by op class) and lifetime (recomputed bytes
    live at the peak, how long recomputed values are held), for one non-monotone pair."""
    lines = [f"budget {flag.low:g} peaks at {fmt_mb(flag.low_peak)} MB, {fmt_mb(flag.excess)} MB "
             f"({flag.ratio:.2f}x) above budget {flag.high:g} ({fmt_mb(flag.high_peak)} MB)"]
    fl, fh = low.facts, high.facts
    if fl is not None and fh is not None:
        lines.append(f"selection: {flag.low:g} saves {fmt_mb(fl.saved_bytes)} MB ({_classes(fl.saved)}) and "
                     f"recomputes {fmt_mb(fl.recomputed_bytes)} MB ({_classes(fl.recomputed)}); {flag.high:g} saves "
                     f"{fmt_mb(fh.saved_bytes)} MB ({_classes(fh.saved)}) and recomputes "
                     f"{fmt_mb(fh.recomputed_bytes)} MB")
        moved = {c: fh.saved.get(c, 0) - fl.saved.get(c, 0) for c in OP_CLASSES}
        more = {c: b for c, b in moved.items() if b > 0}
        fewer = {c: -b for c, b in moved.items() if b < 0}
        if more or fewer:
            lines.append(f"  the larger budget saves more {_classes(more)} MB"
                         + (f" and less {_classes(fewer)} MB" if fewer else ""))
    ml, mh = low.measured, high.measured
    rl, rh = ml.at_peak if ml else {}, mh.at_peak if mh else {}
    if rl or rh:
        rec_l, rec_h = rl.get("recomputed", 0), rh.get("recomputed", 0)
        sav_l, sav_h = rl.get("saved_activation", 0), rh.get("saved_activation", 0)
        mask_l, mask_h = rl.get("rng_mask", 0), rh.get("rng_mask", 0)
        phase = (ml.peak_phase if ml else "") or "?"
        peak = "predicted peak" if ml is not None and ml.at_peak_source == "estimate" else "peak"
        text = (f"lifetime: at {flag.low:g}'s {peak} ({phase}) {fmt_mb(rec_l)} MB are recomputed values and "
                f"{fmt_mb(sav_l)} MB saved activations (at {flag.high:g}: {fmt_mb(rec_h)} and {fmt_mb(sav_h)} MB)")
        if mask_l or mask_h:
            text += f"; dropout masks {fmt_mb(mask_l)} MB (at {flag.high:g}: {fmt_mb(mask_h)} MB)"
        if ml is None or not ml.buffer_level:
            text += " (no Inductor wrapper code: recomputed values count as temporaries)"
        lines.append(text)
    if fl is not None and fl.hold is not None:
        hold_h = f"{fh.hold:.0%}" if fh is not None and fh.hold is not None else "n/a"
        lines.append(f"  recomputed values are held {fl.hold:.0%} of the backward on average, bytes-weighted "
                     f"({fmt_mb(fl.held_long_bytes)} MB for more than half of it); at {flag.high:g}: {hold_h}")
    if fl is not None and fl.recomputed_random:
        lines.append(f"random: {flag.low:g}'s backward redraws {len(fl.recomputed_random)} random ops (dropout masks "
                     f"differ from the forward's: wrong gradients, pytorch#190758)")
    return Diagnosis(variant, flag.low, flag.high, flag.low_peak, flag.high_peak, lines)

