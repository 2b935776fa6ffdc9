"""Where Dynamo broke graphs while a capture ran, and why: read from Dynamo's own record at the
capture's start and stop (nothing is hooked)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any


def _graph_break_reasons() -> list[Any] | None:
    """Dynamo's list of why it broke graphs (`torch._dynamo.utils.graph_break_reasons`: one entry per
    break each time a frame is compiled; `torch._dynamo.reset()` empties it), None without Dynamo."""
    reasons = getattr(sys.modules.get("torch._dynamo.utils"), "graph_break_reasons", None)
    return reasons if isinstance(reasons, list) else None


def graph_break_mark() -> int:
    """Where Dynamo's list of graph breaks stands now (`graph_breaks_since` reads what came after)."""
    reasons = _graph_break_reasons()
    return len(reasons) if reasons is not None else 0


def graph_breaks_since(mark: int) -> list[str]:
    """Each place Dynamo broke a graph since `mark`, once, first seen first: "file:line in fn (from
    file:line in fn): why". A list emptied meanwhile (`torch._dynamo.reset()`) is read whole."""
    reasons = _graph_break_reasons() or []
    places: dict[str, tuple[str, str]] = {}  # innermost frame -> (its caller, why)
    for r in reasons[mark if mark <= len(reasons) else 0:]:
        try:
            stack, why = list(r.user_stack), str(r.reason)
        except Exception:  # (a later torch's entry of another shape: nothing to say about it)
            continue
        if not stack:
            continue
        first = why.strip().splitlines()[0] if why.strip() else ""
        hint = next((ln.strip() for ln in why.splitlines() if ln.strip().startswith("Hint:")), "")
        told = "" if first == "step_unsupported" else first + (f" ({hint})" if hint else "")  # (says nothing)
        inner, caller = _frame(stack[-1]), _frame(stack[-2]) if len(stack) > 1 else ""
        was = places.get(inner, ("", ""))
        places[inner] = (was[0] or caller, was[1] or told)
    # the same break seen again from the frame that called into it (Dynamo compiles that frame's
    # resume on its own): said once, where it happened
    callers = {caller for caller, _ in places.values()}
    return [f"{inner}{f' (from {caller})' if caller else ''}{f': {why}' if why else ''}"
            for inner, (caller, why) in places.items() if why or inner not in callers]


def _frame(f: Any) -> str:
    """`file:line in function` of a traceback frame, the file under site-packages or the working
    directory written from there."""
    name = str(f.filename)
    if "site-packages/" in name:
        name = name.rsplit("site-packages/", 1)[1]
    else:
        with contextlib.suppress(ValueError):  # (another drive: the path as it is)
            rel = os.path.relpath(name)
            name = name if rel.startswith("..") else rel
    return f"{name}:{f.lineno} in {f.name}"
