"""`memprof report CAPTURE`: the peak summary, or an attribution table with --by/--at."""

from __future__ import annotations

import click


@click.command(short_help="Summarize a .memprof capture.")
@click.argument("capture_file", metavar="CAPTURE")
@click.option("--by", type=click.Choice(["category", "node", "layer", "kernel"]), default=None,
              help="Print what is live at --at grouped this way, instead of the summary.")
@click.option("--at", "at", default="peak", show_default=True, metavar="peak|step:N",
              help="Point of the attribution: the peak, or the peak within step N.")
@click.option("--device", default=None, help="Device to attribute (default: the first CUDA device, else cpu).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--top", type=click.IntRange(min=1), default=None,
              help="Rows shown [default: 8 in the summary, 20 in --by tables; JSON tables: all].")
def report(capture_file: str, by: str | None, at: str, device: str | None, as_json: bool, top: int | None) -> None:
    """Print the peak per device, what is live there by category, the largest allocations and steps.

    With --by, print the live bytes at --at grouped by category, FX node, layer or kernel;
    the rows sum exactly to the live bytes at that point.
    """
    from memprof.capture import load
    from memprof.errors import MemprofError
    from memprof.reporters import render

    cap = load(capture_file)
    if device is not None and device not in cap.devices:
        raise MemprofError(f"no allocations on {device} in this capture (devices: {', '.join(cap.devices)})")
    if by is None:
        if at != "peak" or device is not None:
            raise MemprofError("--at and --device need --by (e.g. memprof report CAPTURE --by category --at step:2)")
        click.echo(render("json" if as_json else "text", cap, top=top or 8))
        return
    if as_json:
        click.echo(render("table-json", cap, by=by, at=at, device=device, top=top or 0))
    else:
        click.echo(render("table", cap, by=by, at=at, device=device, top=top or 20))
