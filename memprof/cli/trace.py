"""`memprof trace SCRIPT [ARGS]...`: run a script under capture, save it, print the peak summary."""

from __future__ import annotations

import contextlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from memprof.cli.options import Budget
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


def _report(cap: Any, out: Path, chrome_path: Path | None, save_error: str | None, launch: Path) -> None:
    """The summary first, then where each file went (or why it could not be written)."""
    from memprof.outputs import shown
    from memprof.reporters import render

    click.echo(render("text", cap), err=True)
    if chrome_path is not None:
        try:
            write_text(chrome_path, render("chrome", cap))
            click.echo(f"memprof: Chrome/Perfetto trace written to {shown(chrome_path, launch)} "
                       "(open in ui.perfetto.dev)", err=True)
        except OSError as exc:
            click.echo(f"memprof: error: the Chrome trace could not be written to {chrome_path}: "
                       f"{exc.strerror or exc}", err=True)
    if save_error is None:
        click.echo(f"memprof: capture saved to {shown(out, launch)} (memprof report {shown(out, launch)})", err=True)
    else:
        click.echo(f"memprof: error: {save_error}", err=True)
    sys.stdout.flush()


def traced(path: Path, script_args: list[str], out: Path, chrome_path: Path | None, opts: TraceOptions,
           launch: Path) -> tuple[Any, int]:
    """Run the script under capture as `memprof trace` does (saved whatever happens, summary
    printed); returns the capture and the exit code to end with."""
    import torch._functorch.config as functorch_config

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
                    replace_spill=opts.replace_spill) as cap:
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
    return cap, result.exit_code


@click.command(
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
def trace(script: str, script_args: tuple[str, ...], budget: float | None, remat: str, output: str | None,
          chrome: str | None, force: bool, max_events: int | None, scopes: str, no_kernel_scopes: bool) -> int:
    """Run SCRIPT as `python SCRIPT ARGS` would, capturing every allocation.

    memprof's options may come before or after SCRIPT; other options go to the script,
    and everything after `--` goes to the script verbatim. Exits with the script's exit code.
    """
    from memprof.outputs import check_outputs, resolve
    from memprof.runner import check_script

    launch = Path.cwd()
    path = check_script(script)
    # resolved now: the script may chdir (or remove its directory) before the capture is written
    out = resolve(output or f"{path.stem}.memprof")
    chrome_path = resolve(chrome) if chrome else None
    check_outputs({"-o": out, "--chrome": chrome_path}, [("script", path)], force)
    opts = TraceOptions(budget, remat, max_events, scopes, not no_kernel_scopes, replace_spill=force)
    _cap, code = traced(path, list(script_args), out, chrome_path, opts, launch)
    return code
