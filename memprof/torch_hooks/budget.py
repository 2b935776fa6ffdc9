"""The activation memory budget: the one place memprof sets `torch._functorch.config` (for `trace
--budget`, `sweep`'s children and `--predict`'s shared stages), and reads it."""

from __future__ import annotations

import contextlib
from typing import Any


def budget_set(budget: float | None, **functorch_options: Any) -> contextlib.AbstractContextManager[Any]:
    """`torch._functorch.config.activation_memory_budget` set to `budget` (None: left as it is) and
    any other functorch `functorch_options`, undone on exit."""
    import torch._functorch.config as functorch_config

    values = dict(functorch_options)
    if budget is not None:
        values["activation_memory_budget"] = budget
    return functorch_config.patch(**values) if values else contextlib.nullcontext()


def current_budget() -> float:
    import torch._functorch.config as functorch_config

    return float(functorch_config.activation_memory_budget)
