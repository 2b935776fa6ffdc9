"""Reporters turn a capture into text, JSON or a trace file; registered by name.

Reporters never read files and analysis never prints: each reporter is a pure function
`render(capture, **options) -> str` (bytes for a binary format: the snapshot pickle) plus a
name, a kind ("report" for `memprof report`,
"export" for `memprof export --format`) and the file suffix its output takes
(`memprof.reporters.registry`).
"""

from __future__ import annotations

from typing import Any

from memprof.capture import Capture
from memprof.errors import MemprofError
from memprof.reporters.registry import REGISTRY, Reporter, register

__all__ = ["Reporter", "get", "register", "render", "reporters"]


def reporters(kind: str | None = None) -> dict[str, Reporter]:
    _load_builtin()
    return {n: r for n, r in REGISTRY.items() if kind is None or r.kind == kind}


def get(name: str, kind: str | None = None) -> Reporter:
    available = reporters(kind)
    if name not in available:
        raise MemprofError(f"unknown format {name!r} (available: {', '.join(sorted(available))})")
    return available[name]


def render(name: str, cap: Capture, **options: Any) -> str:
    """A text format's output (binary formats are written by `memprof export`)."""
    out = get(name).render(cap, **options)
    if not isinstance(out, str):
        raise MemprofError(f"{name} is a binary format: write it to a file with memprof export --format {name}")
    return out


def _load_builtin() -> None:
    from memprof.reporters import chrome, html, snapshot, text  # noqa: F401  (registers on import)
