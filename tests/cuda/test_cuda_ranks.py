"""Per-rank capture on one GPU (pytest -m cuda): torchrun with NCCL, a compiled FSDP2 model, world
size 1 (the two-GPU run needs a machine with two)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import memprof

pytestmark = pytest.mark.cuda

FSDP2 = """\
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(0)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
step = torch.compile(model)
opt = torch.optim.AdamW(model.parameters())
ends = []
for _ in range(4):
    step(torch.randn(256, 1024, device="cuda")).square().mean().backward()
    opt.step()
    ends.append(torch.cuda.memory_allocated())  # a step ends at the optimizer's step
    opt.zero_grad()
torch.cuda.synchronize()
json.dump({"max_allocated": torch.cuda.max_memory_allocated(), "ends": ends}, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def test_fsdp2_under_torchrun_on_one_gpu_matches_the_allocator(tmp_path: Path) -> None:
    """The rank's captured peak is its max_memory_allocated() and each step ends at its
    memory_allocated(), to the byte; parameters at the peak are named, and the rows sum to the peak."""
    (tmp_path / "fsdp.py").write_text(FSDP2)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                          "-m", "memprof", "trace", "fsdp.py", "truth.json", "-o", "run.memprof"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    truth = json.loads((tmp_path / "truth.json").read_text())
    cap = memprof.load(tmp_path / "run.rank0.memprof")
    assert cap.meta["distributed"]["backend"] == "nccl" and cap.meta["distributed"]["world_size"] == 1
    assert cap.peak("cuda:0") == truth["max_allocated"]
    assert [s.allocated_at_end for s in cap.steps("cuda:0") if s.complete] == truth["ends"]
    rows = {r.key: r.bytes for r in cap.attribution(by="category", device="cuda:0")}
    assert sum(rows.values()) == cap.peak("cuda:0")
    assert rows.get("parameter", 0) >= 4 * (1024 * 1024 + 1024) * 4, rows
    print("\nFSDP2 on one GPU:", cap.peak("cuda:0"), rows)
