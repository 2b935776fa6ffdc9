"""`memprof export CAPTURE --format chrome [-o OUT]`: write a capture in another format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from memprof.cli.options import StepWindow, reads_captures


class _Formats(click.Choice):  # type: ignore[type-arg]  # generic only in click >= 8.2
    def __init__(self) -> None:
        from memprof.reporters import reporters

        super().__init__(sorted(reporters("export")))


@click.command(short_help="Export a .memprof capture (Chrome/Perfetto trace, HTML report, memory_viz snapshot).")
@click.argument("capture_file", metavar="CAPTURE")
@click.option("--format", "fmt", type=_Formats(), default="chrome", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Output file [default: CAPTURE with the format's suffix]; a name ending in .gz is gzipped "
                   "(trace.json.gz: Perfetto opens it as it is).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--max-counter-points", type=click.IntRange(min=16), default=None,
              help="Chrome: down-sample counter tracks to about this many points (the peak is always kept).")
@click.option("--slices", type=click.Choice(["all", "graphs", "none"]), default=None,
              help="Chrome: host slices kept: every op, kernel and graph call [all]; compiled-graph calls and "
                   "their kernels; or none (counters and markers only: a long capture's trace).")
@click.option("--steps", type=StepWindow(), default=None,
              help="Chrome: only steps A to B (e.g. 10:12), counters opened by their values where step A begins.")
@reads_captures
def export(capture_file: str, fmt: str, output: str | None, force: bool, max_counter_points: int | None,
           slices: str | None, steps: tuple[int, int] | None) -> None:
    """Convert CAPTURE; the Chrome trace opens in ui.perfetto.dev or chrome://tracing, the HTML report
    in any browser (offline), the snapshot (a pickle) in pytorch.org/memory_viz and
    torch.cuda._memory_viz. CAPTURE may name a distributed run (its rank files: one trace)."""
    from memprof.capture import load
    from memprof.errors import MemprofError
    from memprof.outputs import check_outputs, resolve
    from memprof.ranks import load_run
    from memprof.reporters import Run, get, write

    reporter = get(fmt, "export")
    options: dict[str, Any] = {"max_counter_points": max_counter_points, "slices": slices, "steps": steps}
    reporter.make_options(**options)  # (a flag the format does not take: one line, before any reading)
    out = resolve(output) if output else resolve(Path(capture_file).with_suffix(reporter.suffix))
    check_outputs({"-o": out}, [("input capture", resolve(capture_file))], force)
    run = load_run(Path(capture_file))
    source = Run(capture_file, run[0], run[1]) if run is not None else load(capture_file)
    try:
        write(fmt, source, out, **options)
    except OSError as exc:
        raise MemprofError(f"{out} could not be written: {exc.strerror or exc}") from None
    click.echo(f"memprof: wrote {output or out}", err=True)
