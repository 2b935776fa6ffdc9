"""`memprof sweep SCRIPT [ARGS]... --budgets SPEC`: measure the step peak at every budget."""

from __future__ import annotations

import os
from pathlib import Path

import click

from memprof.cli.options import ScriptCommand


@click.command(cls=ScriptCommand,
               short_help="Measure the peak at many activation_memory_budgets and explain the bumps.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--budgets", "spec", required=True,
              help="Budgets: 0.05,0.1,0.3 or START:STOP:STEP (e.g. 0.0:0.30:0.02,1.0), each in [0, 1].")
@click.option("--remat", "remat", type=click.Choice(["light", "all"]), multiple=True,
              help="Also measure memprof's remat pass in this mode, side by side with stock (repeatable).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes at once (one budget each; several GPUs are used round-robin). With --predict, "
                   "more budgets than jobs share the processes: one script start, Dynamo trace and joint graph each.")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Output directory [default: sweep_SCRIPT_STEM].")
@click.option("--force", is_flag=True, help="Replace an existing sweep directory.")
@click.option("--timeout", type=click.FloatRange(min=1), default=None,
              help="Seconds one budget may run before it is stopped (recorded as a timeout); a process "
                   "predicting several budgets may run that long per budget.")
@click.option("--noise-mb", type=click.FloatRange(min=0), default=None,
              help="Peak differences up to this many MB (1e6 B) are noise, not a flag [default: 2% of the "
                   "smallest step peak, at most 1.5 MB].")
@click.option("--noise-rel", type=click.FloatRange(min=0), default=0.005, show_default=True,
              help="... or up to this fraction of the larger budget's peak, whichever is more.")
@click.option("--no-plot", is_flag=True, help="Skip the PNG/SVG plot.")
@click.option("--predict", is_flag=True,
              help="No training step: compile each budget (forward and backward) and draw the curve from "
                   "memprof's compile-time estimate (Inductor's beside it); the script stops at its first backward.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run each budget as a torchrun job of N processes (a distributed script); its step peak is "
                   "the highest rank's, and the table shows the spread between ranks.")
def sweep(script: str, script_args: tuple[str, ...], spec: str, remat: tuple[str, ...], jobs: int,
          output: str | None, force: bool, timeout: float | None, noise_mb: float | None, noise_rel: float,
          no_plot: bool, predict: bool, nproc: int) -> int:
    """Run SCRIPT once per budget (like `memprof trace SCRIPT --budget B`), then tabulate and plot
    the step peaks, flag every pair where less budget gives more memory, and explain each flag
    (what the partitioner saved and recomputed, by op class; what was live at the peak).

    The step peak is the most memory allocated during a training step above what was allocated
    when it began, median over the steps after the first (compiling) one. Which arguments are
    memprof's is decided as for `memprof trace` (see its --help).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memprof.analysis.units import MB
    from memprof.errors import printable
    from memprof.runner import check_script
    from memprof.sweep import parse_budgets, prepare_dir, run_sweep
    from memprof.sweep.result import Run, run_value
    from memprof.sweep.runner import check_nproc
    from memprof.sweep.table import render_findings, render_table

    budgets = parse_budgets(spec)
    check_nproc(predict, nproc)  # before the sweep directory is made
    path = check_script(script)
    out = Path(output) if output else Path(f"sweep_{path.stem}")
    prepare_dir(out, force, path)
    variants = ["stock", *dict.fromkeys(remat)]
    total = len(budgets) * len(variants)
    what = "predicting" if predict else "sweeping"
    click.echo(f"memprof: {what} {len(budgets)} budgets x {len(variants)} variant(s) of {path} "
               f"({jobs} at a time{f', each a torchrun job of {nproc} processes' if nproc > 1 else ''}) into {out}/",
               err=True)
    cores = os.cpu_count() or 1
    if predict and jobs == 1 and total > 1 and cores > 1:
        click.echo(f"memprof: hint: --predict's compiles are CPU-bound and run one after another in one process; "
                   f"--jobs {min(total, cores)} would spread them over the cores (each process also runs one "
                   "forward on the device)", err=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("budgets", total=total)

        def done(run: Run) -> None:
            value = run_value(run, "predict" if predict else "measure")
            peak = f"{value / MB:.1f} MB" if value is not None else run.status
            bar.console.print(f"  {run.variant} {run.budget:g}: {printable(peak)} ({run.wall_s:.0f} s)", markup=False)
            bar.advance(task)

        result = run_sweep(script, list(script_args), budgets, variants, out, jobs=jobs, timeout=timeout,
                           progress=done, predict=predict,
                           noise={"abs_bytes": None if noise_mb is None else noise_mb * MB, "rel": noise_rel},
                           nproc=nproc)
    table = render_table(result)
    click.echo(printable(table))  # errors and names come from the script's runs
    findings = render_findings(result)
    if findings:
        click.echo(printable(findings))
    if not no_plot and any(result.value(r) is not None for r in result.runs):
        from memprof.outputs import write_text
        from memprof.sweep.manifest import record_files
        from memprof.sweep.plot import html_page, plot

        record_files(out, "sweep.png", "sweep.svg", "sweep.html")
        paths = plot(result, out)
        page = write_text(out / "sweep.html", html_page(result, paths[1].read_text(encoding="utf-8"), table, findings))
        click.echo(f"memprof: plot {paths[0]} and {paths[1]}; page {page}", err=True)
    click.echo(f"memprof: results in {out / 'sweep.json'}" + ("" if predict else f", captures in {out}/"), err=True)
    failed = [r for r in result.runs if not r.ok]
    if failed and len(failed) == len(result.runs):
        return 1
    return 0

