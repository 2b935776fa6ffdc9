"""`memprof trace SCRIPT [ARGS]...`: run a script under capture, save it, print the peak summary."""

from __future__ import annotations

import contextlib
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from memprof.capture_info import Keep
from memprof.cli.options import Budget, StepWindow
from memprof.outputs import write_text


def _remat(mode: str) -> contextlib.AbstractContextManager[None]:
    if mode == "off":
        return contextlib.nullcontext()
    from memprof.remat import enable

    return enable(mode)


@dataclass(frozen=True)
class TraceOptions:
    budget: float | None = None
    remat: str = "off"
    max_events: int | None = None
    scopes: str = "ops"
    kernels: bool = True
    knapsack_evaluator: bool = False  # the sweep's measurements also run KnapsackEvaluator
    replace_spill: bool = False  # --force: replace the spill a killed run left beside the output
    keep: Keep = field(default_factory=Keep)  # --steps, --keep-last, --exit-after


def _report(cap: Any, out: Path, chrome_path: Path | None, save_error: str | None, launch: Path) -> None:
    """The summary first, then where each file went (or why it could not be written). Of a
    distributed run's ranks only rank 0 prints it; the others print only what went wrong."""
    from memprof.outputs import shown
    from memprof.reporters import render

    quiet = cap.info.rank not in (None, 0)
    if not quiet:
        click.echo(render("text", cap), err=True)
    if chrome_path is not None:
        try:
            write_text(chrome_path, render("chrome", cap))
            if not quiet:
                click.echo(f"memprof: Chrome/Perfetto trace written to {shown(chrome_path, launch)} "
                           "(open in ui.perfetto.dev)", err=True)
        except OSError as exc:
            click.echo(f"memprof: error: the Chrome trace could not be written to {chrome_path}: "
                       f"{exc.strerror or exc}", err=True)
    if save_error is None and not quiet:
        from memprof.ranks import run_path

        also = f"; every rank's: memprof report {shown(run_path(out), launch)}" if cap.info.rank is not None else ""
        click.echo(f"memprof: capture saved to {shown(out, launch)} (memprof report {shown(out, launch)}{also})",
                   err=True)
    elif save_error is not None:
        click.echo(f"memprof: error: {save_error}", err=True)
    sys.stdout.flush()


def traced(path: Path, script_args: list[str], out: Path, chrome_path: Path | None, opts: TraceOptions,
           launch: Path) -> tuple[Any, int]:
    """Run the script under capture as `memprof trace` does (saved whatever happens, summary
    printed); returns the capture and the exit code to end with."""
    import torch._functorch.config as functorch_config

    from memprof.analysis.window import never_opened
    from memprof.errors import SaveError
    from memprof.outputs import shown
    from memprof.recorder import DEFAULT_MAX_EVENTS, session
    from memprof.runner import SignalGuard, Terminated, interrupted, run_script

    budget_set = (functorch_config.patch(activation_memory_budget=opts.budget) if opts.budget is not None
                  else contextlib.nullcontext())
    meta = {"command": shlex.join(["python", str(path), *script_args]), "argv": [str(path), *script_args],
            "script": str(path.resolve()), "remat": opts.remat,
            "budget": opts.budget if opts.budget is not None else functorch_config.activation_memory_budget}
    cap: Any = None
    result = None
    save_error: str | None = None
    with SignalGuard() as signals:
        try:
            with budget_set, _remat(opts.remat), session(
                    max_events=opts.max_events or DEFAULT_MAX_EVENTS, scopes=opts.scopes, kernels=opts.kernels,
                    meta=meta, output=out, knapsack_evaluator=opts.knapsack_evaluator,
                    replace_spill=opts.replace_spill, keep=opts.keep) as cap:
                try:
                    result = run_script(path, script_args, signals=signals)
                except (KeyboardInterrupt, Terminated) as exc:  # a signal just before the script started
                    signals.script_done()
                    result = interrupted(exc)
                except BaseException:
                    signals.script_done()  # memprof's own failure: the session still saves the capture
                    cap.meta.update(status="memprof-error", exit_code=None)
                    raise
                cap.meta.update(status=result.status, exit_code=result.exit_code, error=result.error)
        except SaveError as exc:
            save_error = str(exc)
        except BaseException:
            if cap is not None and cap.saved_to is not None:
                click.echo(f"memprof: partial capture saved to {shown(out, launch)}", err=True)
            raise
        assert result is not None
        _report(cap, out, chrome_path, save_error, launch)
    if signals.received:  # signals that came while saving: the run ends as they asked, the file written
        return cap, 128 + signals.received[-1]
    empty = never_opened(cap.info)
    if empty is not None and result.exit_code == 0:
        click.echo(f"memprof: error: {empty}", err=True)
        return cap, 1
    return cap, result.exit_code


def _is_window(value: str) -> bool:
    first, sep, last = value.partition(":")
    return bool(sep) and first.strip().isdigit() and last.strip().isdigit()


class _TraceCommand(click.Command):
    """memprof's options may come before or after SCRIPT; `--steps` after SCRIPT is memprof's only
    in its A:B form: training scripts often have a `--steps N` of their own, which stays theirs."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value = {name for p in self.params if isinstance(p, click.Option) and not p.is_flag
                       for name in p.opts}
        at, script = 0, None
        while at < len(args) and script is None:
            arg = args[at]
            if arg == "--":
                break
            if not arg.startswith("-"):
                script = at
            at += 2 if arg in takes_value else 1
        if script is None:
            return super().parse_args(ctx, args)
        head, rest, theirs = args[: script + 1], [], []
        tail = args[script + 1:]
        i = 0
        while i < len(tail):
            arg = tail[i]
            if arg == "--":
                theirs += tail[i + 1:]
                break
            if arg == "--steps" and i + 1 < len(tail) and not _is_window(tail[i + 1]):
                theirs += tail[i : i + 2]
                i += 2
                continue
            if arg.startswith("--steps=") and not _is_window(arg.partition("=")[2]):
                theirs.append(arg)
            else:
                rest.append(arg)
            i += 1
        return super().parse_args(ctx, head + rest + (["--", *theirs] if theirs else []))


@click.command(
    cls=_TraceCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True},
    short_help="Run a script under capture and save a .memprof file.",
)
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--budget", type=Budget(), default=None,
              help="torch._functorch.config.activation_memory_budget for every torch.compile in the script.")
@click.option("--remat", type=click.Choice(["off", "light", "all"]), default="off", show_default=True,
              help="memprof's rematerialization pass for every torch.compile in the script (see docs/remat.md).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Capture file to write [default: SCRIPT_STEM.memprof].")
@click.option("--chrome", type=click.Path(dir_okay=False), default=None,
              help="Also write a Chrome/Perfetto trace (JSON) here.")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@click.option("--max-events", type=click.IntRange(min=1), default=None,
              help="Bound on recorded events (extra events are counted as dropped).")
@click.option("--scopes", type=click.Choice(["ops", "graphs", "none"]), default="ops", show_default=True,
              help="Scopes recorded: every op and kernel, compiled-graph calls only (lower overhead), or none.")
@click.option("--no-kernel-scopes", is_flag=True,
              help="Do not ask Inductor for per-kernel scopes (lower overhead; graph scopes also off).")
@click.option("--steps", "window", type=StepWindow(), default=None,
              help="Store only steps A to B (a step ends at each optimizer step or memprof.step(); the first, "
                   "compiling step is step 1).")
@click.option("--keep-last", type=int, default=None, metavar="N",
              help="Store only the last N steps and the one in progress (a ring: for long jobs, and the OOM at "
                   "their end).")
@click.option("--exit-after", is_flag=True, help="End the script (exit code 0) once the --steps window is recorded.")
def trace(script: str, script_args: tuple[str, ...], budget: float | None, remat: str, output: str | None,
          chrome: str | None, force: bool, max_events: int | None, scopes: str, no_kernel_scopes: bool,
          window: tuple[int, int] | None, keep_last: int | None, exit_after: bool) -> int:
    """Run SCRIPT as `python SCRIPT ARGS` would, capturing every allocation.

    memprof's options may come before or after SCRIPT; other options go to the script,
    and everything after `--` goes to the script verbatim. After SCRIPT, `--steps` is memprof's
    only as a window A:B (`--steps 3` stays the script's). Exits with the script's exit code.
    """
    from memprof.errors import MemprofError
    from memprof.outputs import check_outputs, resolve
    from memprof.ranks import launched_rank, rank_path
    from memprof.runner import check_script

    launch = Path.cwd()
    rank = launched_rank()
    try:
        keep = Keep.of(window, keep_last, exit_after, names=("--steps", "--keep-last", "--exit-after"))
    except MemprofError as exc:
        raise click.UsageError(str(exc)) from None
    path = check_script(script)
    # resolved now: the script may chdir (or remove its directory) before the capture is written
    out = resolve(output or f"{path.stem}.memprof")
    chrome_path = resolve(chrome) if chrome else None
    if rank is not None:  # one file per rank (torchrun): run.memprof -> run.rank3.memprof
        out = rank_path(out, rank.rank)
        chrome_path = rank_path(chrome_path, rank.rank) if chrome_path is not None else None
    check_outputs({"-o": out, "--chrome": chrome_path}, [("script", path)], force)
    opts = TraceOptions(budget, remat, max_events, scopes, not no_kernel_scopes, replace_spill=force, keep=keep)
    _cap, code = traced(path, list(script_args), out, chrome_path, opts, launch)
    return code
