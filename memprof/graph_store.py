"""memprof's records of the graphs Inductor compiled, beside Inductor's own FX graph cache.

A hit in that cache skips the code generation memprof records each buffer's FX nodes and
Inductor's peak estimates from; memprof keeps them for every graph it saw compiled, under the
graph's cache key, so a warm compile under a capture is attributed as the cold one was. One small
JSON file per key, written atomically; a missing or unreadable one is a miss (the graph is then
attributed at kernel level, and the capture says so).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

_VERSION = 1


class GraphRecord(NamedTuple):
    origins: dict[str, list[str]]  # buffer -> the FX nodes it computes
    estimate: int | None  # Inductor's estimate_peak_memory (lowest of its calls)
    estimate_kept: int | None  # the same timeline with graph outputs live to the end


class GraphStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path | None:
        safe = "".join(c for c in key if c.isalnum() or c in "-_")
        return self.root / f"{safe}.json" if safe and len(safe) <= 200 else None

    def put(self, key: str, record: GraphRecord) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _VERSION, **record._asdict()}, f, separators=(",", ":"))
            os.replace(tmp, path)
        except OSError:
            pass  # a cache that cannot be written: the next warm compile is a miss, said there

    def get(self, key: str) -> GraphRecord | None:
        path = self._path(key)
        if path is None:
            return None
        try:
            doc: Any = json.loads(path.read_text())
            origins = doc["origins"]
            if doc.get("version") != _VERSION or not isinstance(origins, dict):
                return None
            est, kept = doc.get("estimate"), doc.get("estimate_kept")
            return GraphRecord({str(k): [str(n) for n in v] for k, v in origins.items()},
                               est if isinstance(est, int) else None, kept if isinstance(kept, int) else None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
