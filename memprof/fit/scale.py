"""`memprof fit --scale "--batch={}" 8:256`: the largest value of a script argument (a batch size, a
sequence length) whose step fits under the limit, at the best configuration for each value.

The peak grows with the value, so the values are searched by bisection: each value probed is one
search of every configuration (compile-time predictions, no training step), and the answer runs
for real once, as `memprof fit` verifies its choice. Values above the answer that were probed say
by how much they are over."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memprof.errors import MemprofError
from memprof.fit.plan import Candidate, Measured, fitting, smallest

MAX_VALUES = 4096


def parse_scale(template: str, spec: str) -> list[int]:
    """The values of a scale: `A:B` doubles from A up to B, `A:B:S` steps by S, `a,b,c` lists them;
    whole numbers > 0, sorted. The template takes each value at its `{}`."""
    if template.count("{}") != 1:
        raise MemprofError(f"--scale {template!r}: the argument needs one {{}} where the value goes "
                           "(e.g. --batch={})")
    values: set[int] = set()
    try:
        for part in (p.strip() for p in spec.split(",")):
            fields = [int(f) for f in part.split(":")]
            if len(fields) == 1:
                values.add(fields[0])
            elif len(fields) in (2, 3):
                start, stop = fields[0], fields[1]
                if start <= 0 or stop < start:
                    raise ValueError
                if len(fields) == 2:
                    v = start
                    while v <= stop:
                        values.add(v)
                        v *= 2
                else:
                    if fields[2] <= 0 or (stop - start) // fields[2] >= MAX_VALUES:
                        raise ValueError
                    values.update(range(start, stop + 1, fields[2]))
            else:
                raise ValueError
    except ValueError:
        raise MemprofError(f"--scale values {spec!r}: give A:B (doubling), A:B:STEP or a list a,b,c of whole "
                           "numbers > 0 with A <= B") from None
    if not values or min(values) <= 0:
        raise MemprofError(f"--scale values {spec!r}: whole numbers > 0")
    return sorted(values)


def with_value(args: Sequence[str], template: str, value: int) -> list[str]:
    return [*args, *shlex.split(template.replace("{}", str(value)))]


@dataclass(frozen=True)
class Probe:
    value: int
    choice: Candidate | None  # the preferred configuration predicted to fit at this value
    smallest: Candidate | None
    ran: Measured | None = None  # a script with nothing to set: its run as it is at this value


@dataclass
class ScaleResult:
    template: str
    values: list[int]
    limit: int
    probes: list[Probe] = field(default_factory=list)
    answer: Probe | None = None  # the largest value whose choice fits (by prediction)
    measured: Measured | None = None  # the answer's verifying run
    failed: list[str] = field(default_factory=list)  # why that run left no figures
    over: list[tuple[int, Measured]] = field(default_factory=list)  # runs over the limit, (value, run), in order
    compiled: bool = True  # False: the script compiles no graph with a backward; each value ran as it is

    @property
    def fits(self) -> bool:
        return self.answer is not None and self.measured is not None and self.measured.within(self.limit)


def bisect(values: Sequence[int], predict: Callable[[int], list[Candidate]], limit: int) -> list[Probe]:
    """Probes, in the order made, of a bisection for the largest value with a configuration predicted
    to fit."""
    return bisect_probes(values, lambda v: probe(v, predict(v), limit))


def bisect_probes(values: Sequence[int], look: Callable[[int], Probe | None]) -> list[Probe]:
    """Probes, in the order made, of a bisection for the largest value whose probe fits (has a
    `choice`; the peak is taken to grow with the value). A value without a probe (`look` gives
    None: its run failed) counts as not fitting."""
    lo, hi = 0, len(values) - 1
    probes: list[Probe] = []
    while lo <= hi:
        mid = (lo + hi) // 2
        found = look(values[mid])
        if found is not None:
            probes.append(found)
        if found is not None and found.choice is not None:
            lo = mid + 1
        else:
            hi = mid - 1
    return probes


def probe(value: int, candidates: Sequence[Candidate], limit: int) -> Probe:
    fits = fitting(candidates, limit)
    return Probe(value, fits[0] if fits else None, smallest(candidates))


def answer(probes: Sequence[Probe]) -> Probe | None:
    fit = [p for p in probes if p.choice is not None]
    return max(fit, key=lambda p: p.value) if fit else None


def scale_dir(out: Path, value: int) -> Path:
    return out / f"scale-{value}"
