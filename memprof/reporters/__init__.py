"""Reporters turn a capture (or a distributed run's captures) into text, JSON or a trace file;
registered by name (`memprof.reporters.registry`).

Reporters never read files and analysis never prints: a reporter writes to the file object it is
given, in its own options (a frozen dataclass); `render` gives a text format's output as a string,
`write` streams any format to a file (gzip-compressed where the name ends in `.gz`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from memprof.capture import Capture
from memprof.errors import MemprofError
from memprof.reporters.registry import REGISTRY, Reporter, Run, register

__all__ = ["Reporter", "Run", "get", "register", "render", "reporters", "write"]


def reporters(kind: str | None = None) -> dict[str, Reporter[Any]]:
    _load_builtin()
    return {n: r for n, r in REGISTRY.items() if kind is None or r.kind == kind}


def get(name: str, kind: str | None = None) -> Reporter[Any]:
    available = reporters(kind)
    if name not in available:
        raise MemprofError(f"unknown format {name!r} (available: {', '.join(sorted(available))})")
    return available[name]


def _emit(reporter: Reporter[Any], source: Capture | Run, options: Any, out: Any) -> None:
    if isinstance(source, Run):
        if reporter.write_run is None:
            raise MemprofError(f"--format {reporter.name} takes one capture: name one rank's file "
                               f"({source.name}.rank0.memprof) or add --rank R")
        reporter.write_run(source, options, out)
    else:
        reporter.write(source, options, out)


def render(name: str, source: Capture | Run, **options: Any) -> str:
    """A text format's output (binary formats are written to a file: `write`)."""
    reporter = get(name)
    if reporter.binary:
        raise MemprofError(f"{name} is a binary format: write it to a file with memprof export --format {name}")
    out = io.StringIO()
    _emit(reporter, source, reporter.make_options(**options), out)
    return out.getvalue()


def write(name: str, source: Capture | Run, path: Path, replace: bool = True, **options: Any) -> Path:
    """Write `path` in format `name` as the reporter goes (`outputs.output_stream`: atomic, gzip
    where the name ends in .gz); without `replace` a file already at `path` is kept (FileExistsError)."""
    from memprof.outputs import output_stream

    reporter = get(name)
    opts = reporter.make_options(**options)
    with output_stream(path, binary=reporter.binary, replace=replace) as out:
        _emit(reporter, source, opts, out)
    return path


def _load_builtin() -> None:
    from memprof.reporters import chrome, html, snapshot, text  # noqa: F401  (registers on import)
