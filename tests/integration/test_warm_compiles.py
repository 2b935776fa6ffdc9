"""A second `memprof trace` of an unchanged script compiles warm: its graphs come from Inductor's
FX graph cache (memprof's own entries, with memprof's record of what a hit skips beside them) and
their kernels from the kernel caches; only AOTAutograd's cache is off (a hit would skip the
partition memprof records). It attributes as the first, buffer by buffer."""

from __future__ import annotations

from pathlib import Path

import memprof

from ..conftest import run_memprof

SCRIPT = """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = torch.compile(model)
for _ in range(3):
    compiled(torch.randn(16, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_second_trace_compiles_warm_and_attributes_as_the_first(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    cache = tmp_path / "inductor"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    first = run_memprof("trace", "train.py", "-o", "first.memprof", cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    built = {p: p.stat().st_mtime_ns for p in cache.rglob("*.so")}
    assert built  # the C++ kernels of the compiled graphs
    assert not (cache / "aotautograd").exists()  # off while recording
    records = sorted(p.name for p in (cache / "memprof").iterdir())
    assert records and list((cache / "fxgraph").iterdir())
    second = run_memprof("trace", "train.py", "-o", "second.memprof", cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.so")} == built  # nothing compiled again
    assert sorted(p.name for p in (cache / "memprof").iterdir()) == records
    a, b = memprof.load(tmp_path / "first.memprof"), memprof.load(tmp_path / "second.memprof")
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
