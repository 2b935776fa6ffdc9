"""memprof's records of what torch.compile's caches let a warm compile skip, beside Inductor's
own cache directory.

A hit in Inductor's FX graph cache skips the code generation memprof records each buffer's FX
nodes and Inductor's peak estimates from: memprof keeps them for every graph it saw compiled,
under the graph's cache key (`GraphRecord`). A hit in AOTAutograd's cache skips the partition as
well, and the FX graph compile: memprof keeps the pair's plan and both compiled graphs, under
AOTAutograd's key (`PairRecord`). So a warm compile under a capture is attributed as the cold one
was. One JSON file per key, written atomically; a missing or unreadable one is a miss (an FX
graph is then attributed at kernel level, and the capture says so; an AOTAutograd hit is compiled
again).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from memprof.plans import CompiledGraph, Plan

_VERSION = 1


class GraphRecord(NamedTuple):
    origins: dict[str, list[str]]  # buffer -> the FX nodes it computes
    estimate: int | None  # Inductor's estimate_peak_memory (lowest of its calls)
    estimate_kept: int | None  # the same timeline with graph outputs live to the end


class PairRecord(NamedTuple):
    plan: Plan | None  # None for an inference graph (no partition)
    graphs: list[CompiledGraph]  # forward (or inference) first, then the backward if any


class GraphStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path | None:
        safe = "".join(c for c in key if c.isalnum() or c in "-_")
        return self.root / f"{safe}.json" if safe and len(safe) <= 200 else None

    def _write(self, key: str, doc: dict[str, Any]) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _VERSION, **doc}, f, separators=(",", ":"))
            os.replace(tmp, path)
        except OSError:
            pass  # a cache that cannot be written: the next warm compile is a miss, said there

    def _read(self, key: str) -> Any:
        path = self._path(key)
        if path is None:
            return None
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and doc.get("version") == _VERSION else None

    def put(self, key: str, record: GraphRecord) -> None:
        self._write(key, record._asdict())

    def put_pair(self, key: str, record: PairRecord) -> None:
        self._write(f"aot-{key}", {"plan": None if record.plan is None else record.plan.to_json(),
                                   "graphs": [{**g.to_json(), "source": g.source} for g in record.graphs]})

    def get_pair(self, key: str) -> PairRecord | None:
        doc = self._read(f"aot-{key}")
        try:
            plan = None if doc["plan"] is None else Plan.from_json(doc["plan"])
            graphs = [CompiledGraph.from_json(g, str(g["source"])) for g in doc["graphs"]]
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return PairRecord(plan, graphs) if graphs else None

    def get(self, key: str) -> GraphRecord | None:
        doc = self._read(key)
        try:
            origins = doc["origins"]
            if not isinstance(origins, dict):
                return None
            est, kept = doc.get("estimate"), doc.get("estimate_kept")
            return GraphRecord({str(k): [str(n) for n in v] for k, v in origins.items()},
                               est if isinstance(est, int) else None, kept if isinstance(kept, int) else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
