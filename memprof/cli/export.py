"""`memprof export CAPTURE --format chrome [-o OUT]`: write a capture in another format."""

from __future__ import annotations

from pathlib import Path

import click


class _Formats(click.Choice):  # type: ignore[type-arg]  # generic only in click >= 8.2
    def __init__(self) -> None:
        from memprof.reporters import reporters

        super().__init__(sorted(reporters("export")))


@click.command(short_help="Export a .memprof capture (Chrome/Perfetto trace, memory_viz snapshot).")
@click.argument("capture_file", metavar="CAPTURE")
@click.option("--format", "fmt", type=_Formats(), default="chrome", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Output file [default: CAPTURE with the format's suffix]; a name ending in .gz is gzipped "
                   "(trace.json.gz: Perfetto opens it as it is).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--max-counter-points", type=click.IntRange(min=16), default=None,
              help="Down-sample counter tracks to about this many points (the peak is always kept).")
@click.option("--slices", type=click.Choice(["all", "graphs", "none"]), default=None,
              help="Chrome: host slices kept: every op, kernel and graph call [all]; compiled-graph calls and "
                   "their kernels; or none (counters and markers only: a long capture's trace).")
def export(capture_file: str, fmt: str, output: str | None, force: bool, max_counter_points: int | None,
           slices: str | None) -> None:
    """Convert CAPTURE; the Chrome trace opens in ui.perfetto.dev or chrome://tracing, the snapshot
    (a pickle) in pytorch.org/memory_viz and torch.cuda._memory_viz."""
    from memprof.capture import load
    from memprof.errors import MemprofError
    from memprof.outputs import check_outputs, resolve, write_output
    from memprof.ranks import load_run
    from memprof.reporters import get

    reporter = get(fmt, "export")
    for name, value in (("--max-counter-points", max_counter_points), ("--slices", slices)):
        if value and fmt != "chrome":
            raise MemprofError(f"{name} applies to --format chrome, not {fmt}")
    out = resolve(output) if output else resolve(Path(capture_file).with_suffix(reporter.suffix))
    check_outputs({"-o": out}, [("input capture", resolve(capture_file))], force)
    options: dict[str, object] = {"max_counter_points": max_counter_points} if max_counter_points else {}
    if slices:
        options["slices"] = slices
    run = load_run(Path(capture_file))
    if run is not None:  # a distributed run's rank files: one trace, a process per rank and device
        import json

        from memprof.reporters.chrome import DEFAULT_MAX_COUNTER_POINTS, chrome_trace_ranks

        if fmt != "chrome":
            raise MemprofError(f"--format {fmt} exports one capture: name one rank's file (run.rank0.memprof)")
        data: str | bytes = json.dumps(chrome_trace_ranks(run[0], max_counter_points or DEFAULT_MAX_COUNTER_POINTS,
                                                          slices or "all"), separators=(",", ":"))
    else:
        data = reporter.render(load(capture_file), **options)
    try:
        write_output(out, data)
    except OSError as exc:
        raise MemprofError(f"{out} could not be written: {exc.strerror or exc}") from None
    click.echo(f"memprof: wrote {output or out}", err=True)

