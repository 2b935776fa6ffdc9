"""`memprof trace SCRIPT [ARGS]...`: run a script under capture, save it, print the peak summary."""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from memprof.cli.options import Budget
from memprof.errors import one_line
from memprof.outputs import write_text


def _write_measure(cap: Any, path: Path) -> None:
    import json

    from memprof.sweep.measure import measure

    d: dict[str, Any] = {"meta": {k: cap.meta.get(k) for k in ("status", "exit_code", "error", "budget", "remat")}}
    try:
        d["measured"] = measure(cap).to_json() if len(cap.raw) else None
    except Exception as exc:  # the capture is saved; the sweep measures it from the file instead
        d["measured"] = None
        d["measure_error"] = f"{one_line(exc)}"
    write_text(path, json.dumps(d))


def _remat(mode: str) -> contextlib.AbstractContextManager[None]:
    if mode == "off":
        return contextlib.nullcontext()
    from memprof.remat import enable

    return enable(mode)


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
@click.option("--measure-json", type=click.Path(dir_okay=False), default=None, hidden=True,
              help="(memprof sweep) write what memprof.sweep.measure finds in the capture here.")
def trace(script: str, script_args: tuple[str, ...], budget: float | None, remat: str, output: str | None,
          chrome: str | None, force: bool, max_events: int | None, scopes: str, no_kernel_scopes: bool,
          measure_json: str | None) -> int:
    """Run SCRIPT as `python SCRIPT ARGS` would, capturing every allocation.

    memprof's options may come before or after SCRIPT; other options go to the script,
    and everything after `--` goes to the script verbatim. Exits with the script's exit code.
    """
    from memprof.capture import DEFAULT_MAX_EVENTS, capture
    from memprof.outputs import check_outputs, resolve, shown
    from memprof.reporters import render
    from memprof.runner import SignalGuard, Terminated, check_script, interrupted, run_script

    launch = Path.cwd()
    path = check_script(script)
    # resolved now: the script may chdir (or remove its directory) before the capture is written
    out = resolve(output or f"{path.stem}.memprof")
    chrome_path = resolve(chrome) if chrome else None
    check_outputs({"-o": out, "--chrome": chrome_path,
                   "--measure-json": resolve(measure_json) if measure_json else None},
                  [("script", path)], force)

    import torch._functorch.config as functorch_config

    if budget is not None:
        functorch_config.activation_memory_budget = budget
    meta = {
        "command": shlex.join(["python", str(path), *script_args]),
        "argv": [str(path), *script_args],
        "script": str(path.resolve()),
        "budget": budget if budget is not None else functorch_config.activation_memory_budget,
        "remat": remat,
    }
    cap = None
    result = None
    save_error: str | None = None
    with SignalGuard() as signals:
        try:
            with _remat(remat), capture(max_events=max_events or DEFAULT_MAX_EVENTS, scopes=scopes,
                                        kernels=not no_kernel_scopes, meta=meta,
                                        knapsack_evaluator=measure_json is not None) as cap:
                result = run_script(path, list(script_args), signals=signals)
        except (KeyboardInterrupt, Terminated) as exc:  # a signal just before the script started
            if cap is None:
                raise
            result = interrupted(exc)
        finally:
            signals.script_done()  # nothing interrupts stopping and saving the capture
            if cap is not None and not cap.recording:
                if result is not None:
                    cap.meta.update(status=result.status, exit_code=result.exit_code, error=result.error)
                else:
                    cap.meta.update(status="memprof-error", exit_code=None)
                save_error = _save(cap, out)
                if result is None and save_error is None:
                    click.echo(f"memprof: partial capture saved to {shown(out, launch)}", err=True)
                if measure_json is not None:
                    _write_measure(cap, resolve(measure_json))
        assert cap is not None and result is not None
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
            click.echo(f"memprof: capture saved to {shown(out, launch)} (memprof report {shown(out, launch)})",
                       err=True)
        else:
            click.echo(f"memprof: error: {save_error}", err=True)
        sys.stdout.flush()
    if signals.received:  # signals that came while saving: the run ends as they asked, the file written
        return 128 + signals.received[-1]
    return result.exit_code


def _save(cap: Any, out: Path) -> str | None:
    """Save the capture; why it could not be written (one line), or None. No partial file is left."""
    try:
        cap.save(out)
    except OSError as exc:
        return f"the capture could not be written to {out}: {exc.strerror or exc}"
    return None
