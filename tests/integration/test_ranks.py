"""Per-rank capture under torchrun (gloo, CPU): each rank writes its own file, only rank 0 prints
the summary, and `memprof report RUN` puts the ranks side by side; a set that is not one whole run
is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import memprof

from ..conftest import invoke_memprof, one_line_error

DDP = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
# compiled inside DDP (torch 2.13 does not compile a DDP module on the CPU: graph breaks in its forward)
model = DDP(torch.compile(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))))
opt = torch.optim.AdamW(model.parameters())
ballast = torch.empty(4096 * (rank + 1))  # rank 1 holds 16 kB more all along
for step in range(3):
    model(torch.randn(32 * (rank + 1), 64)).square().mean().backward()  # and works on twice the batch
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def _torchrun(cwd: Path, out: str, script: str = "ddp.py") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "memprof", "trace", script, "-o", out], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_torchrun_writes_a_capture_per_rank_and_one_merged_report(tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text(DDP)
    res = _torchrun(tmp_path, "run.memprof")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("run*")) == ["run.rank0.memprof", "run.rank1.memprof"]
    assert res.stderr.count("events over") == 1 and res.stderr.count("capture saved to run.rank0.memprof") == 1
    caps = [memprof.load(tmp_path / f"run.rank{r}.memprof") for r in (0, 1)]
    for r, cap in enumerate(caps):
        assert (cap.info.rank, cap.info.world_size, cap.info.backend) == (r, 2, "gloo")
        run_ids = {c.meta["distributed"]["run_id"] for c in caps}
        assert len(run_ids) == 1 and None not in run_ids
        assert sum(row.bytes for row in cap.attribution(by="category")) == cap.peak("cpu")
        assert cap.plans and {c.level for c in cap.labels().calls} == {"buffer"}  # joined to the FX nodes
        assert sum(row.bytes for row in cap.attribution(by="node")) == cap.peak("cpu")
        # DDP's reducer keeps one bucket (under its 25 MB cap) as large as the gradients, all along
        params = (64 * 256 + 256 + 256 * 64 + 64) * 4
        for s in cap.steps("cpu"):
            assert {row.key: row.bytes for row in cap.attribution(at=f"step:{s.step}", by="category")}.get(
                "ddp_bucket") == params, s.step
    peaks = [c.peak("cpu") for c in caps]
    high = max((0, 1), key=lambda r: (peaks[r], -r))
    # (which rank peaks higher is the run's: the compiling step's own allocations vary with timing)
    merged = invoke_memprof("report", "run.memprof", cwd=tmp_path)
    assert merged.returncode == 0, merged.stderr
    lines = merged.stdout.splitlines()
    assert lines[0] == "memprof: run.memprof: 2 ranks (gloo)"
    spread = abs(peaks[1] - peaks[0])
    assert f"{peaks[0]:,}" in lines[2] and f"{peaks[1]:,}" in lines[3]
    assert spread == 0 or (lines[4].startswith(f"  highest: rank {high} (") and f"over rank {1 - high}" in lines[4])
    doc = json.loads(invoke_memprof("report", "run.memprof", "--json", cwd=tmp_path).stdout)
    assert doc["highest_rank"] == high and doc["spread_bytes"] == spread and [r["rank"] for r in doc["ranks"]] == [0, 1]
    # after the compiling step, rank 1 (its ballast, twice the batch) peaks higher
    steps = [{s.step: s.peak for s in c.steps()} for c in caps]
    assert steps[1][3] > steps[0][3]
    one = invoke_memprof("report", "run.memprof", "--rank", "1", "--by", "category", cwd=tmp_path)
    assert one.returncode == 0 and f"live ({caps[1].peak('cpu'):,} bytes) by category" in one.stdout
    # one Chrome trace: a process per rank and device, in one timeline, valid
    from memprof.reporters.chrome import validate_chrome_trace

    exported = invoke_memprof("export", "run.memprof", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    trace = json.loads((tmp_path / "run.json").read_text())
    assert validate_chrome_trace(trace) == []
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
    assert names == ["rank 0: host threads (ops, kernels)", "rank 0: cpu memory",
                     "rank 1: host threads (ops, kernels)", "rank 1: cpu memory"]
    assert trace["otherData"]["aligned"] == "by the host's monotonic clock"
    # bad input, one line each
    assert "out of range: the run had ranks 0 to 1" in one_line_error(
        invoke_memprof("report", "run.memprof", "--rank", "2", cwd=tmp_path))
    assert "--by reports one rank" in one_line_error(invoke_memprof("report", "run.memprof", "--by", "node",
                                                                    cwd=tmp_path))
    assert "is one capture" in one_line_error(invoke_memprof("report", "run.rank0.memprof", "--rank", "0",
                                                             cwd=tmp_path))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is not None:  # memprof around the launcher instead of inside its ranks: the way round, in one line
        assert "-m memprof trace SCRIPT" in one_line_error(invoke_memprof("trace", torchrun, "ddp.py", cwd=tmp_path))
    # another run's rank file in the set: refused; a world size that disagrees: refused; a missing rank: named
    other = tmp_path / "other"
    other.mkdir()
    (other / "eager.py").write_text(DDP.replace("DDP(torch.compile(", "DDP((", 1))
    assert _torchrun(other, "run.memprof", "eager.py").returncode == 0
    shutil.copy(other / "run.rank1.memprof", tmp_path / "run.rank1.memprof")
    assert "come from different runs" in one_line_error(invoke_memprof("report", "run.memprof", cwd=tmp_path))
    caps[1].meta["distributed"]["world_size"] = 3
    caps[1].save(tmp_path / "run.rank1.memprof")
    assert "disagree on the world size" in one_line_error(invoke_memprof("report", "run.memprof", cwd=tmp_path))
    (tmp_path / "run.rank1.memprof").unlink()
    line = one_line_error(invoke_memprof("report", "run.memprof", cwd=tmp_path))
    assert "the run had 2 ranks but the files of rank 1 are missing (expected run.rank1.memprof)" in line


def test_ddp_gradients_as_bucket_views_are_the_bucket(tmp_path: Path) -> None:
    """With `gradient_as_bucket_view=True` the gradients are views into DDP's bucket: the bucket's block
    stays `ddp_bucket` (not the first gradient's name for the whole bucket), and each rank sums exactly."""
    script = DDP.replace("torch.nn.Linear(256, 64))))", "torch.nn.Linear(256, 64))), gradient_as_bucket_view=True)")
    assert script != DDP
    (tmp_path / "ddp.py").write_text(script)
    res = _torchrun(tmp_path, "run.memprof")
    assert res.returncode == 0, res.stderr[-3000:]
    params = (64 * 256 + 256 + 256 * 64 + 64) * 4
    for r in (0, 1):
        cap = memprof.load(tmp_path / f"run.rank{r}.memprof")
        rows = {row.key: row.bytes for row in cap.attribution(by="node")}
        assert sum(rows.values()) == cap.peak("cpu")
        assert rows.get("ddp:buckets", 0) >= params, rows
        assert not any(k.startswith("gradient:") and b >= params for k, b in rows.items()), rows


def test_a_rank_killed_mid_run_leaves_every_rank_capture(tmp_path: Path) -> None:
    """`kill -9` of one rank: torchrun stops the other, whose capture is saved and says why it ended;
    the killed rank's is recovered from its spill; the merged report shows both."""
    import os
    import signal
    import time

    (tmp_path / "long.py").write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo')\n"
        "model = DDP(torch.nn.Linear(64, 64))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(10**7):\n"
        "    model(torch.randn(16, 64)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "memprof", "trace", "long.py", "-o", "run.memprof"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spill = tmp_path / "run.rank1.memprof.spill"
    deadline = time.monotonic() + 120
    while (not spill.exists() or spill.stat().st_size < 1_000_000) and time.monotonic() < deadline:
        time.sleep(0.1)
    rank1 = next(pid for pid in _children(proc.pid)
                 if b"RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    os.kill(rank1, signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    assert (tmp_path / "run.rank0.memprof").exists() and not (tmp_path / "run.rank1.memprof").exists()
    report = invoke_memprof("report", "run.memprof", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "rank 1 ended: cut short (killed or crashed before it saved" in report.stdout
    assert "rank 0 ended:" in report.stdout  # stopped by torchrun (or its peer's loss): said, and saved
    rank0 = memprof.load(tmp_path / "run.rank0.memprof")
    assert rank0.info.status not in (None, "completed") and rank0.info.rank == 0


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers)."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


FSDP2 = """\
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)


# compiled inside each FSDP2 unit: on the CPU, torch 2.13 compiles nothing of fully_shard modules given
# to torch.compile(model) or module.compile() (Dynamo's counters stay empty, without memprof too)
@torch.compile
def block(x, w, b):
    return F.gelu(F.linear(x, w, b))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(128, 128)

    def forward(self, x):
        return block(x, self.lin.weight, self.lin.bias)


model = torch.nn.Sequential(*[Block() for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    model(torch.randn(16, 128)).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def _categories_at(cap: memprof.Capture, row: int) -> dict[str, int]:
    """Live bytes by category just before event `row`."""
    from memprof.analysis.attribution import rows_at

    tl = cap.timeline("cpu")
    return {r.key: r.bytes for r in rows_at(tl, cap.labels("cpu"), tl.pos_before_row(row), "category")}


def test_fsdp2_ranks_hold_and_name_their_shards(tmp_path: Path) -> None:
    """FSDP2 (`fully_shard`) on 2 ranks: each rank's parameters at its peak are its shard, half of
    the model's 264,192 B, named as parameters (a DTensor's local shard), and every rank sums exactly.
    Unsharded parameters (one layer's 66,048 B at a time, or two while the next is prefetched) and
    unsharded gradients exist only inside the forward and backward: none is live where a step ends."""
    (tmp_path / "fsdp.py").write_text(FSDP2)
    res = _torchrun(tmp_path, "run.memprof", "fsdp.py")
    assert res.returncode == 0, res.stderr[-3000:]
    layer = (128 * 128 + 128) * 4
    for r in (0, 1):
        cap = memprof.load(tmp_path / f"run.rank{r}.memprof")
        rows = {row.key: row.bytes for row in cap.attribution(by="category")}
        assert sum(rows.values()) == cap.peak("cpu")
        assert rows["parameter"] == 4 * layer // 2
        assert rows["optimizer_state"] >= 2 * rows["parameter"]  # exp_avg and exp_avg_sq of the shard
        for s in cap.steps("cpu"):
            at_peak = {row.key: row.bytes for row in cap.attribution(at=f"step:{s.step}", by="category")}
            assert sum(at_peak.values()) == s.peak
            if s.step > 1:  # after the compiling step, each step peaks in its backward, mid all-gather
                assert at_peak["unsharded_parameter"] in (layer, 2 * layer), at_peak
                assert at_peak["all_gather"] > 0, at_peak
                # whether the previous layer's reduce-scatter buffers are still held at this peak depends
                # on when gloo's worker threads drop them (CI on a loaded 2-core machine saw none): whole
                # layers if any; that every layer's are made is checked over the capture below
                assert at_peak.get("reduce_scatter", 0) % layer == 0, at_peak
            at_end = _categories_at(cap, s.end_row)
            assert not at_end.get("unsharded_parameter") and not at_end.get("unsharded_gradient"), (s.step, at_end)
            # FSDP2 has let go of every collective buffer by the step's end, but gloo's work objects hold
            # theirs until the worker thread that ran them resets its slot, which it may do after the step:
            # at most one buffer (one layer's) per worker thread, and gloo runs 2 (ProcessGroupGloo's default)
            held = at_end.get("all_gather", 0), at_end.get("reduce_scatter", 0)
            assert all(b % layer == 0 for b in held) and sum(held) <= 2 * layer, at_end
            assert at_end["parameter"] == 4 * layer // 2
        by_node = {row.key: row.bytes for row in cap.attribution(by="node")}
        assert sum(by_node.values()) == cap.peak("cpu")
        assert any(k.startswith("fsdp:FSDP::all_gather_copy_out (") for k in by_node), by_node
        assert "optimizer_state:0.lin.weight.exp_avg" in by_node  # named from the module, not param_groups
        # the compiled blocks: a forward/backward pair recorded, every call joined buffer by buffer
        assert cap.plans and {c.level for c in cap.labels().calls} == {"buffer"}
        # the compiled backward's weight and bias gradients, unsharded until reduce-scattered: 4 layers, 3 steps
        from memprof.analysis.labels import Category

        labels, tl = cap.labels("cpu"), cap.timeline("cpu")
        made = tl.delta[(labels.category == Category.UNSHARDED_GRADIENT) & tl.is_alloc].tolist()
        assert sorted(set(made)) == [128 * 4, 128 * 128 * 4] and len(made) == 4 * 3 * 2, made
        # each layer's gradients reduce-scattered in every step: two one-layer buffers per layer and step
        scattered = tl.delta[(labels.category == Category.REDUCE_SCATTER) & tl.is_alloc].tolist()
        assert scattered == [layer] * (4 * 3 * 2), scattered


# (aot_eager: the sweep's ranks are what is tested, not Inductor's kernels, six compiles of them on the CPU)
SWEEP_DDP = DDP.replace("torch.randn(32 * (rank + 1), 64)", "torch.randn(512 * (rank + 1), 64)").replace(
    "DDP(torch.compile(", "DDP(torch.compile(backend='aot_eager', model=")


def test_sweep_runs_each_budget_as_a_torchrun_job(tmp_path: Path) -> None:
    """`memprof sweep --nproc 2`: each budget a torchrun job; its step peak is the highest rank's (rank
    1 works on twice the batch), every rank's is kept, and the table shows the highest rank and the
    spread. `--predict` with `--nproc` is one line; a rank that fails is the one the budget reports."""
    from memprof.sweep import load_sweep

    (tmp_path / "ddp.py").write_text(SWEEP_DDP)
    res = invoke_memprof("sweep", "ddp.py", "--budgets", "0.5,1.0", "--nproc", "2", "-o", "sw", "--no-plot",
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    sweep = load_sweep(tmp_path / "sw")
    assert sweep.nproc == 2 and len(sweep.runs) == 2
    for run in sweep.runs:
        assert run.ok and run.rank_peaks is not None and len(run.rank_peaks) == 2
        low, high = run.rank_peaks
        assert low is not None and high is not None and high > low
        assert (run.highest_rank, run.step_peak, run.rank_spread) == (1, high, high - low)
        assert run.capture == f"stock_{run.budget:.3f}.rank1.memprof"
        cap = memprof.load(tmp_path / "sw" / run.capture)
        assert cap.info.rank == 1 and cap.info.world_size == 2
    assert "stock highest rank" in res.stdout and "stock rank spread MB" in res.stdout
    bad = invoke_memprof("sweep", "ddp.py", "--budgets", "0.5", "--nproc", "2", "--predict", cwd=tmp_path)
    assert bad.returncode != 0 and "--predict does not take --nproc" in one_line_error(bad)
    # one rank fails: the budget says why (rank 0's own error is only the connection rank 1 dropped)
    fails = "    opt.step()\n    if rank == 1 and step == 1:\n        raise RuntimeError('rank 1 fails')\n"
    (tmp_path / "fail.py").write_text(SWEEP_DDP.replace("    opt.step()\n", fails))
    invoke_memprof("sweep", "fail.py", "--budgets", "1.0", "--nproc", "2", "-o", "swf", "--no-plot", cwd=tmp_path)
    (run,) = load_sweep(tmp_path / "swf").runs
    assert run.status == "exception" and "rank 1 fails" in (run.error or ""), (run.status, run.error)
    assert run.capture == "stock_1.000.rank1.memprof"
