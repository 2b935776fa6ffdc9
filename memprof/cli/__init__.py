"""The `memprof` command line: `trace`, `report`, `export`, `diff`, `sweep` (one module per command).

Errors from bad input are printed as one line (`memprof: error: ...`) with a non-zero exit code and
no traceback; set MEMPROF_DEBUG=1 to see the traceback of internal errors. Run as a program
(`memprof`, `python -m memprof`), memprof's process is the script's: it ends as the script's would
(its exit code, or the signal that ended it).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

import click

from memprof._version import __version__
from memprof.errors import MAX_ERROR_LINE, MemprofError, one_line, printable


class _Commands(click.Group):
    """memprof's commands, with errors that point the way for the two usual slips: a script named
    where a command goes, and a command's option given before the command."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                             list[str]]:
        name = args[0] if args else ""
        if name and self.get_command(ctx, name) is None and (name.endswith((".py", ".pyw")) or os.path.isfile(name)):
            raise click.UsageError(f"{name} is not a command: to trace a script, memprof trace {name} [ARGS]...")
        return super().resolve_command(ctx, args)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            owners = [n for n, c in sorted(self.commands.items()) if not c.hidden and any(
                exc.option_name in p.opts for p in c.params if isinstance(p, click.Option))]
            if not owners:
                raise
            raise click.UsageError(f"{exc.option_name} is an option of memprof {' and '.join(owners)}: put it after "
                                   f"the command (memprof {owners[0]} ... {exc.option_name} ...)") from None


# the commands whose process runs no script of the user's (`sweep` and `fit` start theirs as children)
ANALYSIS_ONLY = frozenset({"report", "export", "diff", "sweep", "fit"})


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memprof")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Exact memory profiles of PyTorch training (CPU and CUDA), with compiled-graph scopes."""
    if ctx.invoked_subcommand in ANALYSIS_ONLY:
        from memprof._events import huge_pages

        huge_pages(False)  # (a traced script's process: only while its capture is saved, `session`)


def _register() -> None:
    from memprof.cli import diff, export, fit, report, sweep, sweep_child, trace

    cli.add_command(trace.trace)
    cli.add_command(sweep_child.sweep_child)
    cli.add_command(report.report)
    cli.add_command(export.export)
    cli.add_command(diff.diff)
    cli.add_command(sweep.sweep)
    cli.add_command(fit.fit)


_register()


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the CLI and turns errors into one line and an exit code. Without `argv`
    (the console script, `python -m memprof`) memprof's process is the script's: Python's exit
    sequence runs when the script's code has, and it ends by the signal that ended the script."""
    from memprof.console import say
    from memprof.runner import Ending, at_exit_end, end_process

    program = argv is None
    if program:
        atexit.register(at_exit_end)  # registered first: runs after every other exit function
    try:
        rv: Any = cli.main(args=argv, prog_name="memprof", standalone_mode=False, obj=program)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        say("memprof: aborted")
        sys.exit(130)
    except click.ClickException as exc:
        say(printable(f"memprof: error: {exc.format_message()}", MAX_ERROR_LINE))
        sys.exit(exc.exit_code)
    except MemprofError as exc:
        say(printable(f"memprof: error: {exc}".splitlines()[0], MAX_ERROR_LINE))
        sys.exit(1)
    except KeyboardInterrupt:
        say("memprof: interrupted")
        sys.exit(130)
    except Exception as exc:  # an internal error: one line unless debugging
        if os.environ.get("MEMPROF_DEBUG"):
            raise
        say(printable(f"memprof: internal error: {one_line(exc)}", MAX_ERROR_LINE) + " (set MEMPROF_DEBUG=1 for a "
            "traceback)")
        sys.exit(3)
    if isinstance(rv, Ending):
        if program:
            end_process(rv)
        sys.exit(rv.code)
    sys.exit(rv if isinstance(rv, int) else 0)
