"""Shared option types for the CLI."""

from __future__ import annotations

import math
from typing import Any

import click


class Budget(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """An activation_memory_budget: a number in [0, 1]."""

    name = "budget"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            b = value
        else:
            try:
                b = float(value)
            except ValueError:
                self.fail(f"--budget must be a number in [0, 1], got {value!r}", param, ctx)
        if math.isnan(b) or not 0.0 <= b <= 1.0:
            self.fail(f"--budget must be in [0, 1], got {value}", param, ctx)
        return b


class StepWindow(click.ParamType):  # type: ignore[type-arg]
    """A step window A:B (steps count from 1, A <= B)."""

    name = "A:B"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        first, sep, last = str(value).partition(":")
        try:
            a, b = int(first), int(last)
        except ValueError:
            a = b = 0
            sep = ""
        if not sep:
            self.fail(f"not a window A:B of step numbers (e.g. 10:12): {value!r}", param, ctx)
        if a < 1 or b < a:
            self.fail(f"{value}: steps count from 1 and a window A:B needs A <= B", param, ctx)
        return a, b
