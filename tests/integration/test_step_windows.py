"""Step windows (`--steps A:B`, `capture(steps=...)`) and the ring of the last steps (`--keep-last N`):
what they store attributes, step by step, to the byte as a full capture of the same run does, because
the blocks live where the stored steps begin are carried in; bad input is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import memprof
from memprof._events import FLAG_CARRIED, Kind
from memprof.errors import MemprofError

from ..conftest import invoke_memprof, one_line_error

# An eager training loop with AdamW (parameters, gradients and optimizer state are known tensors),
# a list that grows every step (blocks that live across the window's start), and a tensor
# allocated in one step and freed in the next.
LOOP = """\
import sys
import torch

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = torch.optim.AdamW(model.parameters())
keep, carry = [], None
for step in range(steps):
    x = torch.randn(32, 64)
    loss = model(x).square().mean() + (carry.sum() if carry is not None else 0)
    loss.backward()
    opt.step()
    opt.zero_grad()
    keep.append(torch.empty(100 + step))
    carry = torch.ones(8 + step)
print("done", steps)
"""


def _run(n: int) -> None:
    ns: dict[str, object] = {}
    saved = sys.argv
    sys.argv = ["loop", str(n)]
    try:
        exec(compile(LOOP, "loop.py", "exec"), ns)
    finally:
        sys.argv = saved


def _same_attribution(full: memprof.Capture, part: memprof.Capture, steps: list[int]) -> None:
    assert [s.step for s in part.steps() if s.complete] == steps
    peaks = {s.step: s.peak for s in full.steps()}
    for s in part.steps():
        if s.complete:
            assert s.peak == peaks[s.step], s.step
    for step in steps:
        for by in ("category", "node", "layer", "kernel"):
            want = sorted((r.key, r.bytes, r.count) for r in full.attribution(at=f"step:{step}", by=by))
            got = sorted((r.key, r.bytes, r.count) for r in part.attribution(at=f"step:{step}", by=by))
            assert got == want, (step, by)


def test_a_step_window_attributes_as_the_full_capture() -> None:
    with memprof.capture() as full:
        _run(8)
    with memprof.capture(steps=(3, 5)) as window:
        _run(8)
    raw = window.raw
    carried = (raw["flags"] & FLAG_CARRIED) != 0
    head = int(carried.sum())
    # the blocks live at the window start lead, then the marker of step 2, then steps 3 to 5 only
    assert head > 0 and carried[:head].all()
    markers = raw["bytes"][raw["kind"] == Kind.STEP].tolist()
    assert raw["kind"][head] == Kind.STEP and markers == [2, 3, 4, 5]
    assert window.info.window == (3, 5) and window.info.window_state == "closed" and window.info.steps == 8
    _same_attribution(full, window, [3, 4, 5])
    assert any("steps 3-5 of the run's 8 are stored" in c for c in window.caveats)
    # the live bytes where the window starts are the full capture's, to the byte
    tl_full, tl_win = full.timeline("cpu"), window.timeline("cpu")
    start_full = full.steps()[2].start_row
    assert tl_win.allocated_before_row(window.steps()[0].start_row) == tl_full.allocated_before_row(start_full)


def test_the_ring_of_the_last_steps_attributes_as_the_full_capture() -> None:
    with memprof.capture() as full:
        _run(9)
    with memprof.capture(keep_last=3) as ring:
        _run(9)
    assert [int(m) for m in ring.raw["bytes"][ring.raw["kind"] == Kind.STEP]] == [6, 7, 8, 9]
    _same_attribution(full, ring, [7, 8, 9])
    assert any("the last 3 steps are stored (steps 7-9" in c for c in ring.caveats)
    # a run shorter than the ring is stored whole, as a full capture
    with memprof.capture(keep_last=20) as short:
        _run(4)
    assert not ((short.raw["flags"] & FLAG_CARRIED) != 0).any()
    assert [s.step for s in short.steps()] == [1, 2, 3, 4]


# A compiled loop as nanoGPT writes it: the next batch is made after the forward (the current one is
# then held only by the autograd graph, which saves it and frees it in the backward), the logits of
# the step before are kept (a compiled forward's output live where the stored steps begin).
COMPILED_LOOP = """\
import torch

torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.a, self.b = torch.nn.Linear(32, 128), torch.nn.Linear(128, 64)

    def forward(self, idx, targets):
        logits = self.b(torch.relu(self.a(self.emb(idx))))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 64), targets.view(-1))
        return loss, logits.detach() * 2


model = Net()
step_fn = torch.compile(model)
opt = torch.optim.AdamW(model.parameters())


def batch():
    return torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))


x, y = batch()
prev = None
for step in range(8):
    loss, logits = step_fn(x, y)
    x, y = batch()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    prev = logits
"""


def _run_compiled() -> None:
    import torch._dynamo

    torch._dynamo.reset()  # (each capture records its own compile: plans are recorded as graphs compile)
    exec(compile(COMPILED_LOOP, "compiled_loop.py", "exec"), {"__name__": "compiled_loop"})


def test_a_window_and_a_ring_of_a_compiled_loop_attribute_as_the_full_capture() -> None:
    """Blocks carried in from compiled calls (the logits kept) are joined to their graph's buffers
    from the scopes they were made in, and a window's blocks freed after it (the next batch, saved
    for its backward) are told saved as in a full capture: every grouping equals it, to the byte."""
    with memprof.capture() as full:
        _run_compiled()
    with memprof.capture(steps=(4, 6)) as window:
        _run_compiled()
    with memprof.capture(keep_last=3) as ring:
        _run_compiled()
    for part, steps in ((window, [4, 5, 6]), (ring, [6, 7, 8])):
        carried = (part.raw["flags"] & FLAG_CARRIED) != 0
        in_calls = [b for b in part.carried if any(part.strings[s].startswith("## Call CompiledFxGraph")
                                                   for s, _ in b.path)]
        assert carried.any() and in_calls, "a compiled forward's output is carried in"
        assert all(part.carried[i].row < part.carried[i + 1].row for i in range(len(part.carried) - 1))
        _same_attribution(full, part, steps)
    markers = np.flatnonzero(window.raw["kind"] == Kind.STEP)
    after = window.raw[markers[-1] + 1:]
    assert len(after) and set(after["kind"].tolist()) <= {Kind.FREE, Kind.SCOPE_BEGIN, Kind.SCOPE_END}
    assert [s.step for s in window.steps()] == [4, 5, 6]  # what follows the window is no step


def test_the_ring_holds_only_its_steps_in_memory() -> None:
    """The store frees the chunks behind the ring: its memory stays about the ring's size."""
    import torch

    from memprof._native import native

    held = []
    with memprof.capture(keep_last=2, scopes="none"):
        for _ in range(40):
            for _i in range(20_000):  # ~40,000 events a step: more than a chunk (32,768 events)
                torch.empty(8)
            memprof.step()
            held.append(native().store_bytes())
    chunk = 32_768 * 56
    # 2 complete steps and the one in progress (~2.2 MB each) at most: 5 chunks, where the whole run is 49
    assert max(held) <= 5 * chunk


def test_bad_windows_are_one_line() -> None:
    for kwargs, words in (({"steps": (0, 2)}, "count from 1"), ({"steps": (5, 3)}, "A <= B"),
                          ({"steps": (1,)}, "window A:B"), ({"keep_last": 0}, "at least 1"),
                          ({"steps": (1, 2), "keep_last": 3}, "cannot be combined")):
        with pytest.raises(MemprofError, match=words), memprof.capture(**kwargs):  # type: ignore[arg-type]
            pass
    assert not memprof.recorder.active()


def test_trace_windows_and_their_bad_input(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text(LOOP)
    for args, words in ((["--steps", "3"], "not a window A:B"), (["--steps", "a:b"], "not a window"),
                        (["--steps", "4:2"], "A <= B"), (["--steps", "0:2"], "count from 1"),
                        (["--keep-last", "0"], "at least 1"), (["--steps", "1:2", "--keep-last", "2"], "combined"),
                        (["--exit-after"], "--exit-after ends the script after a step window")):
        line = one_line_error(invoke_memprof("trace", *args, "loop.py", cwd=tmp_path))
        assert words in line, line
    assert not list(tmp_path.glob("*.memprof"))
    # after SCRIPT, --steps N is the script's own (scripts often have one), in its place; --steps A:B is memprof's
    (tmp_path / "argv.py").write_text("import sys\nprint('ARGV', sys.argv[1:])\n")
    res = invoke_memprof("trace", "argv.py", "--steps", "3", "x", "--steps=4", "--steps", "1:1", "-o", "a.memprof",
                         cwd=tmp_path)
    assert res.returncode == 0 and "ARGV ['--steps', '3', 'x', '--steps=4']" in res.stdout, res.stderr
    assert memprof.load(tmp_path / "a.memprof").info.window == (1, 1)
    res = invoke_memprof("trace", "loop.py", "--steps", "2:3", "--exit-after", "5", cwd=tmp_path)
    assert res.returncode == 0 and "done" not in res.stdout, res.stderr  # ended after step 3, cleanly
    cap = memprof.load(tmp_path / "loop.memprof")
    assert [s.step for s in cap.steps()] == [2, 3] and cap.info.ended_by == "exit-after"
    assert cap.info.status == "exit" and cap.info.window == (2, 3)
    # a window that never opens: said in one line, exit 1, what exists saved
    res = invoke_memprof("trace", "loop.py", "--steps", "20:22", "--force", "3", cwd=tmp_path)
    errors = [line for line in res.stderr.splitlines() if line.startswith("memprof: error:")]
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(errors) == 1
    assert "never opened: the script made only 3 steps" in errors[0]
    empty = memprof.load(tmp_path / "loop.memprof")
    assert len(empty.raw) == 0 and empty.caveats[0].startswith("EMPTY: the step window 20:22 never opened")
    report = invoke_memprof("report", "loop.memprof", cwd=tmp_path)
    assert report.returncode == 0 and "never opened" in report.stdout
    # a window the script ends inside
    res = invoke_memprof("trace", "loop.py", "--steps", "2:9", "--force", "4", cwd=tmp_path)
    assert res.returncode == 0 and "cut short: the script made only 4 steps, so steps 2-4 are stored" in res.stderr


def test_a_killed_ring_is_recovered_and_its_spill_stays_bounded(tmp_path: Path) -> None:
    """With --keep-last, the spill is written anew from the ring's start once it holds twice the
    ring: after a kill it holds the last steps, carried blocks first, and stays small."""
    script = ("import torch, memprof\n"
              "keep = [torch.empty(1000)]\n"
              "for step in range(100_000):\n"
              "    for i in range(2_000):\n"
              "        t = torch.empty(64 + i % 7)\n"
              "    keep.append(torch.empty(10))\n"
              "    memprof.step()\n")
    (tmp_path / "train.py").write_text(script)
    proc = subprocess.Popen([sys.executable, "-m", "memprof", "trace", "--keep-last", "5", "train.py", "-o",
                             "run.memprof"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spill = tmp_path / "run.memprof.spill"
    sizes = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.25)
        if spill.exists():
            sizes.append(spill.stat().st_size)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    cap = memprof.load(tmp_path / "run.memprof")
    markers = [int(m) for m in cap.raw["bytes"][cap.raw["kind"] == Kind.STEP]]
    assert cap.info.status == "cut short" and markers[-1] > 20  # the run went on well past the ring
    assert len(markers) <= 2 * 5 + 2 and markers == list(range(markers[0], markers[-1] + 1))
    carried = (cap.raw["flags"] & FLAG_CARRIED) != 0
    # every block of the list made before the spill's start is carried in (the first one, 4,000 B, too)
    blocks = cap.raw[carried & (cap.raw["kind"] == Kind.ALLOC)]
    assert 4000 in blocks["bytes"].tolist() and (blocks["bytes"] == 40).sum() == markers[0]
    # ~12,000 events a step (0.7 MB): the ring is ~4 MB and the spill at most about twice that, however
    # many steps ran (hundreds here: the whole run would be hundreds of MB)
    assert markers[-1] > 200 and max(sizes) < 16_000_000
    step = cap.steps()[1]
    rows = cap.attribution(at=f"step:{step.step}", by="kernel")
    assert sum(r.bytes for r in rows) == step.peak


def test_the_bundled_example_windowed_and_ringed_attributes_as_its_full_capture(tmp_path: Path) -> None:
    """The compiled example, traced unmodified three ways (in parallel): every complete step that a
    window and a ring store attributes, by category, FX node, layer and kernel, as the full capture.
    One intra-op thread each: what CPU worker threads allocate depends on how they are scheduled, so
    two runs of the example match to the byte only then."""
    example = str(Path(__file__).resolve().parents[2] / "examples" / "train_llama.py")
    ways = {"full": [], "window": ["--steps", "4:6"], "ring": ["--keep-last", "3"]}
    procs = {name: subprocess.Popen([sys.executable, "-m", "memprof", "trace", *args, "-o", f"{name}.memprof",
                                     example, "--steps", "9", "--device", "cpu"], cwd=tmp_path,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
             for name, args in ways.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, err[-2000:])
    full, window, ring = (memprof.load(tmp_path / f"{name}.memprof") for name in ways)
    assert full.plans and window.plans and ring.plans  # the first step compiles: recorded outside the window too
    _same_attribution(full, window, [4, 5, 6])
    _same_attribution(full, ring, [7, 8, 9])
    assert all(c.level == "buffer" for c in window.labels().calls)  # the window's graph calls join buffer by buffer
