"""Ranks: under torchrun (or any launcher that sets torch.distributed's RANK and WORLD_SIZE) each
rank writes its own capture, `OUT.rank{R}.memprof` beside the `-o OUT.memprof` it was given; the
rank files of one run form its set, which `memprof report OUT.memprof` reads whole."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memprof.errors import MemprofError

if TYPE_CHECKING:
    from memprof.capture import Capture

_RANK_FILE = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>\d+)\.memprof(?P<spill>\.spill)?$")


@dataclass(frozen=True)
class Rank:
    """Where a process stands in its distributed job, as the launcher set it."""

    rank: int
    world_size: int
    local_rank: int
    node: int  # torchrun's GROUP_RANK (the node's index), 0 without one
    run_id: str | None  # TORCHELASTIC_RUN_ID: the same on every rank of one torchrun job

    def to_meta(self) -> dict[str, Any]:
        return asdict(self)


def launched_rank(env: Mapping[str, str] = os.environ) -> Rank | None:
    """This process's rank, from the launcher's environment; None outside a distributed launch."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local, node = int(env.get("LOCAL_RANK", rank)), int(env.get("GROUP_RANK", 0))
    except ValueError:
        raise MemprofError(f"RANK={env.get('RANK')!r} and WORLD_SIZE={env.get('WORLD_SIZE')!r} (set by the "
                           "launcher) are not whole numbers") from None
    if not 0 <= rank < world:
        raise MemprofError(f"RANK={rank} is outside WORLD_SIZE={world} (set by the launcher)")
    return Rank(rank, world, local, node, env.get("TORCHELASTIC_RUN_ID") or None)


def rank_path(path: Path, rank: int) -> Path:
    """`run.memprof` -> `run.rank3.memprof` (any other suffix is kept: `t.json` -> `t.rank3.json`)."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def run_path(path: Path) -> Path:
    """The inverse of `rank_path`: `run.rank3.memprof` -> `run.memprof` (other names are returned as they are)."""
    m = _RANK_FILE.match(path.name)
    return path.with_name(f"{m['stem']}.memprof") if m is not None and not m["spill"] else path


def rank_files(path: Path) -> dict[int, Path]:
    """The rank files of the run named `path` (`run.memprof`, or `run`): rank -> file; a rank whose
    capture was never written but whose spill was left (the rank was killed) counts by its spill."""
    base = path if path.suffix == ".memprof" else path.with_name(path.name + ".memprof")
    folder = base.parent if str(base.parent) else Path(".")
    out: dict[int, Path] = {}
    if not folder.is_dir():
        return out
    for p in folder.iterdir():
        m = _RANK_FILE.match(p.name)
        if m is None or m["stem"] != base.stem:
            continue
        rank = int(m["rank"])
        file = p.with_name(p.name.removesuffix(".spill"))
        if not m["spill"] or not file.exists():
            out[rank] = file  # `memprof.load` recovers a capture from the spill beside a missing file
    return dict(sorted(out.items()))


def check_set(path: Path, metas: Mapping[int, Mapping[str, Any]]) -> int:
    """Refuse a set that is not one whole run (one line each); returns its world size."""
    worlds, runs = {}, {}
    for rank, meta in metas.items():
        d = meta.get("distributed")
        if not isinstance(d, dict):
            raise MemprofError(f"{rank_path(path, rank)} was not written by a rank of a distributed run")
        if d.get("rank") != rank:
            raise MemprofError(f"{rank_path(path, rank)} holds rank {d.get('rank')}, not rank {rank}: "
                               "rank files were renamed or mixed")
        worlds[rank], runs[rank] = d.get("world_size"), d.get("run_id")
    if len(set(runs.values())) > 1:
        raise MemprofError(f"the rank files of {path} come from different runs (torchrun run ids "
                           f"{', '.join(f'rank {r}: {v}' for r, v in runs.items())}): keep one run's files together")
    if len(set(worlds.values())) > 1:
        raise MemprofError(f"the rank files of {path} disagree on the world size "
                           f"({', '.join(f'rank {r}: {w}' for r, w in worlds.items())})")
    world = next(iter(worlds.values()))
    if not isinstance(world, int) or world < 1:
        raise MemprofError(f"{path}: rank files without a world size")
    missing = [r for r in range(world) if r not in metas]
    if missing:
        raise MemprofError(f"{path}: the run had {world} ranks but the files of rank{'s' if len(missing) > 1 else ''} "
                           f"{', '.join(map(str, missing))} are missing (expected {rank_path(path, missing[0])})")
    return world


def load_run(path: Path) -> tuple[dict[int, Capture], int] | None:
    """The captures of the distributed run named `path` (checked: `check_set`) and its world size;
    None when `path` is one capture (a file, or the spill a killed run left) or names no run."""
    from memprof.capture import load
    from memprof.spill import spill_path

    if path.exists() or spill_path(path).exists():
        return None
    files = rank_files(path)
    if not files:
        return None
    caps = {r: load(f) for r, f in files.items()}
    return caps, check_set(path, {r: c.meta for r, c in caps.items()})
