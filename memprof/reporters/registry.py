"""The reporter registry: one dict drives `memprof report` and `memprof export --format`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Render = Callable[..., str | bytes]  # bytes: a binary format (a pickle)


@dataclass(frozen=True)
class Reporter:
    name: str
    kind: str  # "report" or "export"
    suffix: str
    description: str
    render: Render


REGISTRY: dict[str, Reporter] = {}


def register(name: str, kind: str, suffix: str, description: str) -> Callable[[Render], Render]:
    def wrap(fn: Render) -> Render:
        if name in REGISTRY:
            raise ValueError(f"reporter {name!r} registered twice")
        REGISTRY[name] = Reporter(name, kind, suffix, description, fn)
        return fn

    return wrap
