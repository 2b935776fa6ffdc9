"""`memprof trace SCRIPT [ARGS]...`: run a script under capture, save it, print the peak summary."""

from __future__ import annotations

from pathlib import Path

import click

from memprof.capture_info import Keep
from memprof.cli.options import Budget, ScriptCommand, StepWindow


@click.command(cls=ScriptCommand, short_help="Run a script under capture and save a .memprof file.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--budget", type=Budget(), default=None,
              help="torch._functorch.config.activation_memory_budget for every torch.compile in the script; "
                   "a size (24GB, 22.5GiB) plans the budget and remat mode whose predicted peak fits under it, "
                   "as memprof fit does (no training step), and runs with that.")
@click.option("--remat", type=click.Choice(["off", "light", "all"]), default="off", show_default=True,
              help="memprof's rematerialization pass for every torch.compile in the script (see docs/remat.md).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Capture file to write [default: SCRIPT_STEM.memprof].")
@click.option("--chrome", type=click.Path(dir_okay=False), default=None,
              help="Also write a Chrome/Perfetto trace (JSON) here.")
@click.option("--html", type=click.Path(dir_okay=False), default=None,
              help="Also write the HTML report here (one file; opens offline).")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@click.option("--max-events", type=click.IntRange(min=1), default=None,
              help="Bound on recorded events (extra events are counted as dropped) [default: none; the "
                   "events stream to the output's spill].")
@click.option("--scopes", type=click.Choice(["ops", "graphs", "none"]), default="ops", show_default=True,
              help="Scopes recorded: every compiled-graph call and every op that allocates or frees, "
                   "compiled-graph calls only, or none.")
@click.option("--kernel-scopes/--no-kernel-scopes", default=False, show_default=True,
              help="Also record a scope per compiled kernel launch (Inductor's own) and every op inside "
                   "compiled-graph calls (by default a graph's later calls record only the calls that "
                   "allocate): a trace of every launch, at a host-bound step's cost. Buffers name their "
                   "kernel either way.")
@click.option("--steps", "window", type=StepWindow(), default=None,
              help="Store only steps A to B (a step ends at each optimizer step or memprof.step(); the first, "
                   "compiling step is step 1).")
@click.option("--keep-last", type=int, default=None, metavar="N",
              help="Store only the last N steps and the one in progress (a ring: for long jobs, and the OOM at "
                   "their end).")
@click.option("--exit-after", is_flag=True, help="End the script (exit code 0) once the --steps window is recorded.")
@click.pass_context
def trace(ctx: click.Context, script: str, script_args: tuple[str, ...], budget: float | int | None, remat: str,
          output: str | None, chrome: str | None, html: str | None, force: bool, max_events: int | None, scopes: str,
          kernel_scopes: bool, window: tuple[int, int] | None, keep_last: int | None, exit_after: bool) -> object:
    """Run SCRIPT as `python SCRIPT ARGS` would, capturing every allocation; exits as the script does.

    \b
    Which arguments are memprof's:
    - before SCRIPT, every option;
    - after SCRIPT, only memprof's own options written as their names (--budget 0.05,
      --budget=0.05, -o FILE, --force, ...); the summary's first line names those it took.
      Everything else is the script's, in the order given. After SCRIPT, --steps is
      memprof's only as a window A:B (--steps 100 stays the script's), and -h/--help are
      the script's.
    - The first `--` after SCRIPT ends memprof's options: it is dropped and all that follows
      goes to the script as it is, a later `--` included (s.py x -- -- y gives the script
      x -- y). With `--` before SCRIPT (memprof trace [OPTIONS] -- SCRIPT ARGS), nothing
      after SCRIPT is memprof's.
    """
    from memprof.errors import MemprofError
    from memprof.outputs import check_outputs, resolve
    from memprof.ranks import launched_rank, rank_path
    from memprof.runner import TraceOptions, check_script, traced

    launch = Path.cwd()
    rank = launched_rank()
    taken: tuple[str, ...] = ctx.meta.get("taken", ())
    try:
        keep = Keep.of(window, keep_last, exit_after, names=("--steps", "--keep-last", "--exit-after"))
    except MemprofError as exc:
        raise click.UsageError(str(exc)) from None
    path = check_script(script)
    # resolved now: the script may chdir (or remove its directory) before the capture is written
    out = resolve(output or f"{path.stem}.memprof")
    exports = {fmt: resolve(p) for fmt, p in (("chrome", chrome), ("html", html)) if p}
    if rank is not None:  # one file per rank (torchrun): run.memprof -> run.rank3.memprof
        out = rank_path(out, rank.rank)
        exports = {fmt: rank_path(p, rank.rank) for fmt, p in exports.items()}
    after = {opt: "; memprof took " + opt + " from after the script: a " + opt + " of the script's own goes after --"
             for opt in ("-o", "--output", "--chrome", "--html") if opt in taken}
    check_outputs({"-o": out, "--chrome": exports.get("chrome"), "--html": exports.get("html")}, [("script", path)],
                  force, hints={"-o": after.get("-o", after.get("--output", "")), "--chrome": after.get("--chrome", ""),
                                "--html": after.get("--html", "")})
    if isinstance(budget, int):  # a size: the plan that fits under it
        if rank is not None:
            raise MemprofError("--budget with a size plans in one process: run memprof fit first, then launch the "
                               "ranks with the budget it chose")
        from memprof.fit import plan

        config = plan(script, list(script_args), budget, None if remat == "off" else remat)
        budget, remat = config.budget, config.remat or "off"
    opts = TraceOptions(budget, remat, max_events, scopes, kernel_scopes, force=force, keep=keep, taken=taken)
    return traced(script, list(script_args), out, exports, opts, launch, exiting=ctx.obj is True).ending
