"""`memprof _sweep-child` (hidden): what `memprof sweep` runs in each of its processes.

Measured (one budget): the script traced as `memprof trace` would, its capture saved with `-o`,
and what `memprof.sweep.measure` finds in it. Predicted (`--predict`, one or more budgets sharing
the process): `memprof.sweep.predict`. Either way one `ChildResult` JSON per budget (`--json`, in
the order of `--budget`), which the sweep reads back.
"""

from __future__ import annotations

from pathlib import Path

import click

from memprof.errors import MemprofError, one_line
from memprof.outputs import json_text, write_text


def _measured(cap: object, budget: float, remat: str) -> str:
    from memprof.capture import Capture
    from memprof.sweep.measure import ChildResult, measure

    assert isinstance(cap, Capture)
    meta = cap.meta
    result = ChildResult(budget, remat, str(meta.get("status")), meta.get("exit_code"), meta.get("error"), None)
    try:
        result.measured = measure(cap) if len(cap.raw) else None
    except Exception as exc:  # the capture is saved; the sweep measures it from the file instead
        result.measure_error = one_line(exc)
    return json_text(result.to_json())


@click.command("_sweep-child", hidden=True,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.pass_context
@click.option("--budget", "budgets", type=float, multiple=True, required=True)
@click.option("--json", "json_paths", type=click.Path(dir_okay=False), multiple=True, required=True)
@click.option("--remat", type=click.Choice(["off", "light", "all"]), default="off")
@click.option("--predict", is_flag=True, help="Compile and predict each budget; run no training step.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="(measured) the capture file.")
@click.option("--device-lock", type=click.Path(dir_okay=False), default=None,
              help="(predicted) run compiled graphs only while holding this lock (the device taken in turns).")
@click.option("--step-lock", type=click.Path(dir_okay=False), default=None,
              help="(measured) compile beside the others, time the steps after the first alone (`sweep.turns`).")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def sweep_child(ctx: click.Context, budgets: tuple[float, ...], json_paths: tuple[str, ...], remat: str,
                predict: bool, output: str | None, device_lock: str | None, step_lock: str | None, script: str,
                script_args: tuple[str, ...]) -> object:
    """(memprof sweep) One budget measured, or a group of budgets predicted."""
    from memprof.outputs import resolve
    from memprof.runner import check_script

    if len(json_paths) != len(budgets):
        raise MemprofError(f"{len(budgets)} --budget but {len(json_paths)} --json")
    check_script(script)
    # everything after SCRIPT is the script's (options are not interspersed here); the sweep puts
    # a `--` right after SCRIPT
    args = list(script_args[1:] if script_args[:1] == ("--",) else script_args)
    if predict:
        from memprof.sweep.predict import predict as run_predict

        results = run_predict(script, args, list(budgets), None if remat == "off" else remat,
                              resolve(device_lock) if device_lock else None)
        for p, r in zip(json_paths, results, strict=True):
            write_text(resolve(p), json_text(r.to_json()))
            if r.status != "completed" or r.measured is None:
                click.echo(f"memprof: budget {r.budget:g} not predicted ({r.status}): {r.error}", err=True)
            else:
                m = r.measured
                click.echo(f"memprof: predicted budget {r.budget:g}: {m.estimates} ({m.own_compile_s or 0:.1f} s own "
                           f"compile, {m.shared_s or 0:.1f} s shared)", err=True)
        return 0 if all(r.status == "completed" for r in results) else 1
    if len(budgets) != 1 or output is None:
        raise MemprofError("a measured budget runs alone, with -o for its capture")
    from memprof.ranks import launched_rank, rank_path
    from memprof.runner import TraceOptions, traced

    out, json_path = resolve(output), resolve(json_paths[0])
    rank = launched_rank()
    if rank is not None:  # one of a torchrun job's ranks (memprof sweep --nproc)
        out, json_path = rank_path(out, rank.rank), rank_path(json_path, rank.rank)

    def finished(cap: object) -> None:  # (also when a fatal signal, the sweep's timeout, is about to end it)
        write_text(json_path, _measured(cap, budgets[0], remat))

    turn = None
    if step_lock:
        from memprof.sweep.turns import StepTurn

        turn = StepTurn(resolve(step_lock))
        turn.start()
    opts = TraceOptions(budgets[0], remat, knapsack_evaluator=True, before_marker=turn.before_marker if turn else None)
    return traced(script, args, out, {}, opts, Path.cwd(), exiting=ctx.obj is True, finished=finished).ending
