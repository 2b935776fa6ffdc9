"""Shared option types and command decorators for the CLI."""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable
from typing import Any, TypeVar

import click

from memprof.cli.args import split_command


class Budget(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """An activation_memory_budget: a number in [0, 1] (a float), or a size with a unit (`24GB`,
    `22.5GiB`: an int of bytes, the peak the step must fit under)."""

    name = "budget"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | int:
        if isinstance(value, float | int) and not isinstance(value, bool):
            return value
        from memprof.analysis.units import parse_budget

        try:
            return parse_budget(str(value))
        except ValueError as exc:
            self.fail(str(exc) if param is not None else f"--budget: {exc}", param, ctx)  # (click names it)


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


class Limit(click.ParamType):  # type: ignore[type-arg]
    """A limit on growth: a size (`64MB`, `1.5GiB`: bytes) or a share (`5%`: a float fraction)."""

    name = "SIZE|N%"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | float:
        from memprof.analysis.units import parse_size

        if isinstance(value, (int, float)):
            return value
        text = str(value).strip()
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                pct = -1.0
            if not 0 <= pct < math.inf:
                self.fail(f"{value!r} is not a percentage >= 0 (e.g. 5%)", param, ctx)
            return pct / 100
        try:
            return parse_size(text)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class ScriptCommand(click.Command):
    """A command of the form `memprof CMD [OPTIONS] SCRIPT [ARGS]...`: its arguments are split by
    `memprof.cli.args` (memprof's options before SCRIPT, its own names after it, the rest the
    script's in order); the options taken from after SCRIPT are in `ctx.meta["taken"]`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        options = [p for p in self.params if isinstance(p, click.Option)]
        takes_value = {name for p in options if not p.is_flag for name in p.opts}
        flags = {name for p in options if p.is_flag for name in p.opts}
        nargs = {name: p.nargs for p in options if not p.is_flag and p.nargs > 1 for name in p.opts}
        split = split_command(args, takes_value, flags, nargs=nargs)
        ctx.meta["taken"] = tuple(split.taken)
        if split.script is None:
            return super().parse_args(ctx, args)
        return super().parse_args(ctx, [*split.before, *split.taken, "--", split.script, *split.script_args])


F = TypeVar("F", bound=Callable[..., Any])


def reads_captures(command: F) -> F:
    """A command that only reads captures (report, export, diff) runs without Python's cyclic
    garbage collector: reading one makes hundreds of thousands of small objects (the plans' FX
    nodes, the strings) and no reference cycles, and every full collection walks them all
    (docs/benchmarks.md, session 7). The collector's state is restored after (the commands also run
    inside other processes: tests, notebooks)."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return command(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run  # type: ignore[return-value]
