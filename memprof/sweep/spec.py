"""Budget specs for `memprof sweep --budgets`: `0.05,0.1,0.3` or `START:STOP:STEP` (pure)."""

from __future__ import annotations

import math

from memprof.errors import MemprofError

MAX_BUDGETS = 1000


def _number(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise MemprofError(f"--budgets {spec!r}: {text.strip()!r} is not a number") from None
    if math.isnan(value) or math.isinf(value):
        raise MemprofError(f"--budgets {spec!r}: {text.strip()!r} is not a finite number")
    return value


def _in_range(value: float, spec: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise MemprofError(f"--budgets {spec!r}: {value:g} is outside [0, 1]")
    return value


def parse_budgets(spec: str) -> list[float]:
    """The budgets of a spec, sorted and without duplicates.

    Parts are separated by commas; each is a number or `START:STOP:STEP` (STOP included when
    the steps reach it, to within 1e-9), e.g. `0.0:0.30:0.02,1.0`.
    """
    if not spec or not spec.strip():
        raise MemprofError("--budgets is empty (give e.g. 0.05,0.1,0.3 or 0.05:0.30:0.01)")
    out: set[float] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise MemprofError(f"--budgets {spec!r}: an empty item between commas")
        if ":" in part:
            fields = part.split(":")
            if len(fields) != 3:
                raise MemprofError(f"--budgets {spec!r}: a range is START:STOP:STEP, got {part!r}")
            start, stop, step = (_number(f, spec) for f in fields)
            _in_range(start, spec)
            _in_range(stop, spec)
            if step <= 0:
                raise MemprofError(f"--budgets {spec!r}: the step must be > 0, got {step:g}")
            if stop < start:
                raise MemprofError(f"--budgets {spec!r}: STOP {stop:g} is below START {start:g}")
            count = math.floor((stop - start) / step + 1e-9) + 1
            if count > MAX_BUDGETS:
                raise MemprofError(f"--budgets {spec!r}: {count} budgets (at most {MAX_BUDGETS})")
            # rounded so that 0.05 + 2 * 0.01 is 0.07, not 0.07000000000000001
            out.update(round(start + i * step, 10) for i in range(count))
        else:
            out.add(round(_in_range(_number(part, spec), spec), 10))
    return sorted(out)


def budget_label(budget: float) -> str:
    """A stable file-name label: 0.05 -> "0.050", 1.0 -> "1.000"."""
    return f"{budget:.3f}" if round(budget, 3) == budget else f"{budget:g}"
