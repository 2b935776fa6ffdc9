"""`memprof diff A B`: what changed at the peak (or at step:N) from one capture to another."""

from __future__ import annotations

from pathlib import Path

import click

from memprof.cli.options import Limit, reads_captures

_BY = ("category", "node", "layer", "kernel")


@click.command(short_help="What changed at the peak between two captures.")
@click.argument("a_file", metavar="A")
@click.argument("b_file", metavar="B")
@click.option("--at", "at", default="peak", show_default=True, metavar="peak|step:N",
              help="Compare the live bytes at each capture's peak, or at the peak within step N.")
@click.option("--device", default=None, help="Device to compare (default: the one both captures peaked on).")
@click.option("--by", "by", type=click.Choice(_BY), multiple=True,
              help="Tables to print (repeatable) [default: all four].")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Rows shown per table.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every row).")
@click.option("--html", "html_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the diff as one self-contained page here.")
@click.option("--force", is_flag=True, help="Overwrite an existing --html file.")
@click.option("--fail-above", type=Limit(), default=None,
              help="Exit 1 when B's bytes exceed A's by more than this (64MB, 1GiB or 5%): a memory regression gate.")
@reads_captures
def diff(a_file: str, b_file: str, at: str, device: str | None, by: tuple[str, ...], top: int, as_json: bool,
         html_out: str | None, force: bool, fail_above: int | float | None) -> int:
    """Compare capture B with capture A (e.g. stock against --remat light, eager against compiled,
    one torch version against the next): B's live bytes at the point minus A's, by category, FX
    node, layer and kernel. Each table's rows sum exactly to the difference."""
    from memprof.analysis.diff import diff as diff_captures
    from memprof.analysis.units import fmt_bytes
    from memprof.capture import load
    from memprof.console import say
    from memprof.errors import MemprofError
    from memprof.outputs import check_outputs, json_text, resolve, write_text
    from memprof.reporters.diff import diff_html, format_diff

    if resolve(a_file) == resolve(b_file):
        raise MemprofError(f"A and B are the same file ({a_file}): diff compares two captures")
    page = resolve(html_out) if html_out else None
    check_outputs({"--html": page}, [("capture A", resolve(a_file)), ("capture B", resolve(b_file))], force)
    a, b = load(a_file), load(b_file)
    d = diff_captures(a, b, at, device)
    if page is not None:
        write_text(page, diff_html(d, Path(a_file).name, Path(b_file).name))
    over = None
    if fail_above is not None:
        limit = fail_above if isinstance(fail_above, int) else round(fail_above * d.a_total)
        over = d.delta > limit
    if as_json:
        out = {"a": str(a_file), "b": str(b_file), **d.to_json()}
        if fail_above is not None:
            out["fail_above_bytes"] = limit
            out["failed"] = over
        click.echo(json_text(out, indent=1))
    else:
        click.echo(format_diff(d, Path(a_file).name, Path(b_file).name, list(by or _BY), top))
    if over:
        what = f"{fail_above * 100:g}% of A" if isinstance(fail_above, float) else fmt_bytes(limit)
        say(f"memprof: B exceeds A by {fmt_bytes(d.delta)} ({d.delta:+,} B), more than --fail-above {what}")
        return 1
    return 0
