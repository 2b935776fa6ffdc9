"""The activation memory budget: the one place memprof sets `torch._functorch.config` (for `trace
--budget`, `sweep`'s children and `--predict`'s shared stages), and reads it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

# set (in the environment, so a script's own processes see it too) while a budget memprof set is in
# force: a script's `memprof.remat.enable(budget=SIZE)` then leaves the configuration as it is (the
# script runs under `memprof trace --budget`, or as a child of `memprof fit`, `sweep` or its own plan)
CONFIGURED_ENV = "MEMPROF_BUDGET_SET"


def budget_set(budget: float | None, **functorch_options: Any) -> contextlib.AbstractContextManager[Any]:
    """`torch._functorch.config.activation_memory_budget` set to `budget` (None: left as it is) and
    any other functorch `functorch_options`, undone on exit."""
    import torch._functorch.config as functorch_config

    values = dict(functorch_options)
    if budget is None:
        return functorch_config.patch(**values) if values else contextlib.nullcontext()
    values["activation_memory_budget"] = budget
    return _patched(functorch_config.patch(**values), repr(budget))


@contextlib.contextmanager
def _patched(patch: contextlib.AbstractContextManager[Any], budget: str) -> Iterator[None]:
    with patch, _environment(CONFIGURED_ENV, budget):
        yield


def budget_set_by_memprof() -> bool:
    """Whether a budget memprof set is in force in this process or the one that started it."""
    return bool(os.environ.get(CONFIGURED_ENV))


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def current_budget() -> float:
    import torch._functorch.config as functorch_config

    return float(functorch_config.activation_memory_budget)
