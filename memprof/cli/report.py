"""`memprof report CAPTURE`: the peak summary, or an attribution table with --by/--at."""

from __future__ import annotations

from pathlib import Path

import click

from memprof.cli.options import reads_captures


@click.command(short_help="Summarize a .memprof capture.")
@click.argument("capture_file", metavar="CAPTURE")
@click.option("--by", type=click.Choice(["category", "node", "layer", "kernel", "step"]), default=None,
              help="Print what is live at --at grouped this way, instead of the summary; step: a row per step.")
@click.option("--at", "at", default="peak", show_default=True, metavar="peak|step:N",
              help="Point of the attribution: the peak, or the peak within step N.")
@click.option("--device", default=None, help="Device to attribute (default: the first CUDA device, else cpu).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--top", type=click.IntRange(min=1), default=None,
              help="Rows shown [default: 8 in the summary, 20 in --by tables; JSON tables: all].")
@click.option("--rank", type=int, default=None, help="Of a distributed run's rank files: report this rank.")
@reads_captures
def report(capture_file: str, by: str | None, at: str, device: str | None, as_json: bool, top: int | None,
           rank: int | None) -> None:
    """Print the peak per device, what is live there by category, the largest allocations and steps.

    With --by, print the live bytes at --at grouped by category, FX node, layer or kernel;
    the rows sum exactly to the live bytes at that point. CAPTURE may name a distributed run
    (`-o run.memprof` under torchrun wrote run.rank0.memprof, run.rank1.memprof, ...): its ranks
    side by side, or one of them with --rank.
    """
    from memprof.capture import load
    from memprof.errors import MemprofError
    from memprof.ranks import load_run
    from memprof.reporters import Run, render

    run = load_run(Path(capture_file))
    if run is None:
        if rank is not None:
            raise MemprofError(f"--rank needs a distributed run's name; {capture_file} is one capture")
        cap = load(capture_file)
    else:
        caps, world = run
        if rank is None:
            if by is not None:
                raise MemprofError(f"--by reports one rank: add --rank R (0 to {world - 1})")
            click.echo(render("json" if as_json else "text", Run(capture_file, caps, world)), nl=False)
            return
        if rank not in caps:
            raise MemprofError(f"--rank {rank} is out of range: the run had ranks 0 to {world - 1}")
        cap = caps[rank]
    if device is not None and device not in cap.devices:
        raise MemprofError(f"no allocations on {device} in this capture (devices: {', '.join(cap.devices)})")
    if by is None:
        if at != "peak" or device is not None:
            raise MemprofError("--at and --device need --by (e.g. memprof report CAPTURE --by category --at step:2)")
        click.echo(render("json" if as_json else "text", cap, top=top or 8), nl=False)
        return
    click.echo(render("table-json" if as_json else "table", cap, by=by, at=at, device=device, top=top), nl=False)
