"""The `memprof` command line: `trace`, `report`, `export`, `sweep` (one module per command).

Errors from bad input are printed as one line (`memprof: error: ...`) with a non-zero
exit code and no traceback; set MEMPROF_DEBUG=1 to see the traceback of internal errors.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from memprof._version import __version__
from memprof.errors import MAX_ERROR_LINE, MemprofError, one_line, printable
from memprof.runner import Terminated


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memprof")
def cli() -> None:
    """Exact memory profiles of PyTorch training (CPU and CUDA), with compiled-graph scopes."""


def _register() -> None:
    from memprof.cli import export, report, sweep, sweep_child, trace

    cli.add_command(trace.trace)
    cli.add_command(sweep_child.sweep_child)
    cli.add_command(report.report)
    cli.add_command(export.export)
    cli.add_command(sweep.sweep)


_register()


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the CLI and turns errors into one line and an exit code."""
    try:
        rv = cli.main(args=argv, prog_name="memprof", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("memprof: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(printable(f"memprof: error: {exc.format_message()}", MAX_ERROR_LINE), err=True)
        sys.exit(exc.exit_code)
    except MemprofError as exc:
        click.echo(printable(f"memprof: error: {exc}".splitlines()[0], MAX_ERROR_LINE), err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("memprof: interrupted", err=True)
        sys.exit(130)
    except Terminated as exc:  # SIGTERM or SIGHUP before a capture started
        click.echo(f"memprof: terminated ({signal.Signals(exc.signum).name})", err=True)
        sys.exit(128 + exc.signum)
    except Exception as exc:  # an internal error: one line unless debugging
        if os.environ.get("MEMPROF_DEBUG"):
            raise
        click.echo(printable(f"memprof: internal error: {one_line(exc)}", MAX_ERROR_LINE)
                   + " (set MEMPROF_DEBUG=1 for a traceback)", err=True)
        sys.exit(3)
    sys.exit(rv if isinstance(rv, int) else 0)
