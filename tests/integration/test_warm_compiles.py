"""A second `memprof trace` of an unchanged script compiles warm: its forward/backward pairs come
from AOTAutograd's cache and their graphs from Inductor's FX graph cache (memprof's own entries,
with memprof's record of what each hit skips beside them), their kernels from the kernel caches.
It records the same plans and graphs as the first and attributes as the first, buffer by buffer;
a hit memprof has no record of is compiled again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import memprof

from ..conftest import run_memprof

SCRIPT = """\
import json
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = torch.compile(model)
for _ in range(3):
    compiled(torch.randn(16, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
from torch._dynamo.utils import counters
json.dump({**counters["aot_autograd"], **counters["inductor"]}, open("counters.json", "w"))
"""


def test_a_second_trace_compiles_warm_and_attributes_as_the_first(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    cache = tmp_path / "inductor"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    first = run_memprof("trace", "train.py", "-o", "first.memprof", cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    counted = json.loads((tmp_path / "counters.json").read_text())
    assert counted.get("autograd_cache_saved") == 1 and not counted.get("autograd_cache_hit"), counted
    built = {p: p.stat().st_mtime_ns for p in cache.rglob("*.so")}
    assert built  # the C++ kernels of the compiled graphs
    records = sorted(p.name for p in (cache / "memprof").iterdir())
    assert len([r for r in records if r.startswith("aot-")]) == 1 and list((cache / "fxgraph").iterdir())
    second = run_memprof("trace", "train.py", "-o", "second.memprof", cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    counted = json.loads((tmp_path / "counters.json").read_text())
    assert counted.get("autograd_cache_hit") == 1 and not counted.get("autograd_cache_miss"), counted
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.so")} == built  # nothing compiled again
    assert sorted(p.name for p in (cache / "memprof").iterdir()) == records
    a, b = memprof.load(tmp_path / "first.memprof"), memprof.load(tmp_path / "second.memprof")
    assert [p.to_json() for p in a.plans] == [p.to_json() for p in b.plans]
    # the same graphs, by Inductor's own cache keys (a hit: memprof names no graph itself)
    assert [g.key for g in a.graphs] == [g.key for g in b.graphs] and not b.graphs[0].key.startswith("memprof-")
    assert [g.source for g in a.graphs] == [g.source for g in b.graphs] and [g.origins for g in a.graphs] == [
        g.origins for g in b.graphs]
    assert len(a.plans) == len(b.plans) > 0
    assert not any("without memprof's record" in n for n in b.meta["notes"])
    assert all(c.level == "buffer" for c in b.labels().calls)
    for step in (1, 2, 3):
        for by in ("category", "node", "layer", "kernel"):
            assert ([(r.key, r.bytes, r.count) for r in a.attribution(at=f"step:{step}", by=by)]
                    == [(r.key, r.bytes, r.count) for r in b.attribution(at=f"step:{step}", by=by)]), (step, by)


def test_a_cache_hit_without_memprofs_record_compiles_again(tmp_path: Path) -> None:
    """AOTAutograd's entry is there, memprof's record of it is not (removed, or written by a run
    that memprof did not see): the hit is turned into a miss, and the pair is compiled and recorded."""
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert run_memprof("trace", "train.py", "-o", "first.memprof", cwd=tmp_path, env=env).returncode == 0
    shutil.rmtree(tmp_path / "inductor" / "memprof")
    second = run_memprof("trace", "train.py", "-o", "second.memprof", cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    counted = json.loads((tmp_path / "counters.json").read_text())
    assert counted.get("autograd_cache_miss") == 1 and not counted.get("autograd_cache_hit"), counted
    assert counted.get("fxgraph_cache_miss") == 2 and not counted.get("fxgraph_cache_hit"), counted
    a, b = memprof.load(tmp_path / "first.memprof"), memprof.load(tmp_path / "second.memprof")
    assert [p.to_json() for p in a.plans] == [p.to_json() for p in b.plans]
    assert [(g.key, g.origins) for g in a.graphs] == [(g.key, g.origins) for g in b.graphs]
    assert all(c.level == "buffer" for c in b.labels().calls)
    assert any(p.name.startswith("aot-") for p in (tmp_path / "inductor" / "memprof").iterdir())
