"""Byte formatting and the CUDA caching allocator's block rounding, defined once."""

from __future__ import annotations

import numpy as np

MB = 1e6  # decimal megabytes, as the paper and nvidia-smi use
CUDA_BLOCK = 512  # the caching allocator rounds every request up to 512-byte granules
CUDA_LARGE_SLACK = 1 << 20  # a block may be up to 1 MiB larger than its rounded request (no split below)


def fmt_bytes(n: int | None) -> str:
    """Human-readable size in decimal units ("12.3 MB"); "-" for None."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if v < 1000 or unit == "TB":
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.1f} {unit}"
        v /= 1000
    raise AssertionError("unreachable")


def fmt_mb(n: float | None) -> str:
    """Bytes as MB (1e6 B) with one decimal, "n/a" for None (tables of many rows in one unit)."""
    return "n/a" if n is None else f"{n / MB:.1f}"


def round_up(nbytes: int, block: int = CUDA_BLOCK) -> int:
    """`nbytes` rounded up to a multiple of `block` (a block of 1 or less: unchanged; 0 stays 0)."""
    return ((nbytes + block - 1) // block) * block if block > 1 and nbytes > 0 else nbytes


def round_up_array(nbytes: np.ndarray, block: int = CUDA_BLOCK) -> np.ndarray:
    """`round_up` of the absolute values of an array of byte counts."""
    return np.asarray(((np.abs(nbytes) + block - 1) // block) * block, dtype=np.int64)


def block_fits(nbytes: int | None, block: int, cpu: bool) -> bool:
    """Whether an allocation of `nbytes` (None: unknown, any) can be a block of `block` bytes: the
    same on the CPU; on CUDA the caching allocator's 512-byte granules, and large blocks are not
    split below 1 MiB."""
    if nbytes is None:
        return True
    if cpu:
        return block == nbytes
    rounded = max(CUDA_BLOCK, round_up(nbytes))
    return rounded <= block <= rounded + CUDA_LARGE_SLACK


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, unit_required: bool = False) -> int:
    """Bytes from a size as users write it: `64MB`, `22.5GiB`, `8000 MB`, `512` (bytes). Decimal
    units are powers of 1000 (as `fmt_bytes` prints them), binary ones (KiB, MiB, GiB) of 1024.
    `unit_required`: a bare number is refused (where `24` meant as 24 GB would plan for 24 bytes);
    `24B` is bytes. Raises ValueError naming what was wrong."""
    s = text.strip().replace("_", "")
    before_unit = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    num, unit = before_unit.strip(), s[len(before_unit):].lower()
    if unit_required and not unit and num:
        raise ValueError(f"{text!r} has no unit: write {num}GB, {num}GiB or {num}MB ({num}B for bytes)")
    if unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: unknown unit {unit!r} (use B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (a number and a unit, e.g. 64MB or 22.5GiB)") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{text!r} is not a size: it must be a finite number >= 0")
    return round(value * _UNITS[unit])


def parse_budget(text: str) -> float | int:
    """An activation memory budget as users write it: a ratio in [0, 1] (`0.05`: a float) or a size
    with a unit (`24GB`, `22.5GiB`: an int of bytes, more than 0, the peak a step must fit under).
    Raises ValueError naming what was wrong."""
    s = text.strip()
    if s[:1].isdigit() and s[-1:].isalpha():
        return checked_budget(parse_size(s), repr(text))
    try:
        ratio = float(s)
    except ValueError:
        raise ValueError(f"a budget must be a number in [0, 1] or a size with a unit (24GB), not {text!r}") from None
    return checked_budget(ratio, text)


def checked_budget(value: float | int, said: str | None = None) -> float | int:
    """`value` as a budget (`parse_budget`'s kinds: a float ratio in [0, 1], an int of bytes more
    than 0), or ValueError naming it as `said` (default its repr)."""
    said = repr(value) if said is None else said
    if isinstance(value, bool) or not isinstance(value, float | int):
        raise ValueError(f"a budget is a ratio in [0, 1] or a size in bytes, not {said}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{said}: a size must be more than 0 bytes")
    elif not 0.0 <= value <= 1.0:  # (NaN fails both)
        raise ValueError(f"a budget must be in [0, 1] (or a size with a unit: 24GB), not {said}")
    return value


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`1 row`, `2 rows`, `1,024 allocations`: a count and its noun in the right number."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
