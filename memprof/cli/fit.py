"""`memprof fit SCRIPT [ARGS]... --memory SIZE`: the configuration that fits, proved by a run."""

from __future__ import annotations

from pathlib import Path

import click

from memprof.cli.options import ScriptCommand


@click.command(cls=ScriptCommand, short_help="Find the configuration that fits in a memory limit, and prove it.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--memory", "memory", required=True, metavar="SIZE|device",
              help="The limit: 24GB, 22.5GiB, 8000MB, or 'device' (the device's free memory now; on the CPU, "
                   "the machine's available memory).")
@click.option("--budgets", "spec", default="0.0,0.02,0.05,0.1,0.2,0.3,0.5,1.0", show_default=True,
              help="The activation_memory_budgets searched: 0.05,0.1 or START:STOP:STEP.")
@click.option("--remat", "remat", type=click.Choice(["off", "light", "all"]), multiple=True,
              help="The remat modes searched at every budget beside stock [default: light]; off: stock only.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Predicting processes at once [default: with a GPU, one per configuration up to the cores; "
                   "on the CPU, the cores up to 4].")
@click.option("-o", "--output", type=click.Path(file_okay=False), default=None,
              help="Output directory [default: fit_SCRIPT_STEM]: the predictions, the verifying runs' "
                   "captures, fit.json.")
@click.option("--force", is_flag=True, help="Replace an existing fit directory.")
@click.option("--timeout", type=click.FloatRange(min=1), default=None, help="Seconds one run may take.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--predictions", "reuse", type=click.Path(exists=True, path_type=Path), default=None,
              help="An earlier fit of the same command (its output directory): take its predictions instead of "
                   "compiling again, to try another limit at the cost of the verifying run alone.")
@click.option("--scale", nargs=2, default=None, metavar="ARG VALUES",
              help='The largest value of a script argument that fits: ARG has {} where the value goes '
                   '("--batch={}"), VALUES is A:B (doubling), A:B:STEP or a,b,c.')
def fit(script: str, script_args: tuple[str, ...], memory: str, spec: str, remat: tuple[str, ...],
        jobs: int | None, output: str | None, force: bool, timeout: float | None, as_json: bool,
        scale: tuple[str, str] | None, reuse: Path | None) -> int:
    """Predict the peak of every configuration memprof can set (stock budgets, and its remat pass at
    each) with no training step, run the one that fits with the least recomputation, and print the
    certificate: the limit, the predicted and measured peak, the margin, the command and the lines
    of Python that apply it. When nothing fits, it says by how much and what would close the gap.
    Exit status 0 when a configuration fits, 1 when none does."""
    import json
    import os

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from memprof.analysis.units import fmt_bytes, parse_size
    from memprof.errors import MemprofError, printable
    from memprof.fit import check_predictions, default_jobs, device_limit, device_total, fit_scale
    from memprof.fit import fit as run_fit
    from memprof.fit.report import fit_json, format_fit, format_scale, scale_json
    from memprof.fit.scale import parse_scale
    from memprof.outputs import json_text, write_text
    from memprof.runner import check_script
    from memprof.sweep import parse_budgets, prepare_dir
    from memprof.sweep.manifest import record_files

    if memory.strip().lower() == "device":
        limit = device_limit()
    else:
        try:
            limit = parse_size(memory, unit_required=True)
        except ValueError as exc:
            raise MemprofError(f"--memory: {exc}") from None
    if limit <= 0:
        raise MemprofError("--memory must be more than 0 bytes")
    whole = device_total()
    if whole is not None and limit > whole[1]:
        raise MemprofError(f"--memory {memory.strip()} is more than {whole[0]}'s total memory ({fmt_bytes(whole[1])}): "
                           "no run here can prove a plan under it (give at most that, or --memory device)")
    budgets = parse_budgets(spec)
    values = parse_scale(*scale) if scale else None
    path = check_script(script)
    modes = [m for m in dict.fromkeys(remat) if m != "off"] if remat else ["light"]
    out = Path(output) if output else Path(f"fit_{path.stem}")
    if reuse is not None and os.path.realpath(out) in (os.path.realpath(reuse), os.path.realpath(reuse.parent)):
        raise MemprofError(f"--predictions {reuse} is in the output directory {out}, which this fit replaces: "
                           "give another -o")
    if reuse is not None:
        check_predictions(reuse, script, list(script_args), budgets, modes, scale[0] if scale else None, values or ())
    prepare_dir(out, force, path)
    jobs = jobs or default_jobs(len(budgets) * (1 + len(modes)))
    total = 0 if reuse else len(budgets) * (1 + len(modes)) * (max(1, len(values).bit_length()) if values else 1)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("predicting", total=total)

        def step(_run: object) -> None:
            if bar.tasks[task].completed < total:
                bar.advance(task)
            else:
                bar.update(task, description="verifying")

        if scale and values:
            scaled = fit_scale(script, list(script_args), scale[0], values, limit, budgets, modes, out, jobs=jobs,
                               timeout=timeout, progress=step, reuse=reuse)
        else:
            result = run_fit(script, list(script_args), limit, budgets, modes, out, jobs=jobs, timeout=timeout,
                             progress=step, reuse=reuse)
    record_files(out, "fit.json")
    if scale and values:
        doc, text, fits = scale_json(scaled), format_scale(scaled, [script, *script_args]), scaled.fits
    else:
        doc, text, fits = fit_json(result), format_fit(result), result.fits
    write_text(out / "fit.json", json.dumps(doc, indent=1) + "\n")
    click.echo(json_text(doc, indent=1) if as_json else printable(text))
    click.echo(f"memprof: results in {out / 'fit.json'}", err=True)
    return 0 if fits else 1
