"""`memprof report CAPTURE`: the peak summary of a saved capture."""

from __future__ import annotations

import click


@click.command(short_help="Summarize a .memprof capture.")
@click.argument("capture_file", metavar="CAPTURE")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True,
              help="Rows in each 'largest' table.")
def report(capture_file: str, as_json: bool, top: int) -> None:
    """Print the peak per device, the largest live allocations and scopes at the peak, and steps."""
    from memprof.fileformat import load
    from memprof.reporters import render

    cap = load(capture_file)
    click.echo(render("json" if as_json else "text", cap, top=top))
