"""memprof never calls a wrong number exact and never loses or clobbers data (issue 17): frees and
allocations on other threads, bounded captures, step figures, output paths, signals and full disks
while saving, permissions, interpreter exit, messages about the user's script."""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import memprof
from memprof._events import FLAG_OTHER_THREAD
from memprof.errors import IncompleteCaptureError
from memprof.reporters import render
from memprof.sweep.manifest import MANIFEST, prepare_dir, record_files

from ..conftest import invoke_memprof, one_line_error, run_memprof

MB4 = 4_000_000


# -- other threads -------------------------------------------------------------------------------

def test_frees_and_allocations_on_other_threads_are_seen() -> None:
    """A data pipeline's hand-off: the main thread allocates, a worker frees. Each free is seen, so
    the peak is one tensor, not all of them; a tensor allocated on another thread is seen too."""
    handed: list[torch.Tensor] = []
    freed = threading.Event()
    go = threading.Event()

    def worker() -> None:
        for _ in range(10):
            go.wait()
            go.clear()
            handed.pop()  # the last reference: freed on this thread
            freed.set()

    with memprof.capture() as cap:
        t = threading.Thread(target=worker)
        t.start()
        for _ in range(10):
            handed.append(torch.empty(MB4 // 4))
            freed.clear()
            go.set()
            freed.wait()
        t.join()
        kept: list[torch.Tensor] = []

        def allocate_elsewhere() -> None:
            kept.append(torch.empty(250_000))

        other = threading.Thread(target=allocate_elsewhere)
        other.start()
        other.join()
    assert cap.peak("cpu") == MB4  # was 40,000,000 with the frees unseen
    tl = cap.timeline("cpu")
    assert tl.final == 1_000_000  # the tensor allocated on the other thread, still live
    allocs = tl.is_alloc.nonzero()[0]
    assert (tl.free_of[allocs] >= 0).sum() == 10  # every hand-off paired with its free
    threads = cap.raw["thread"][tl.rows]
    assert len(set(threads.tolist())) == 3
    other = (cap.raw["flags"][tl.rows] & FLAG_OTHER_THREAD) != 0  # not autograd's: kept out of "backward"
    assert (other == (threads != cap.meta["main_thread"])).all()
    assert cap.meta["cpu_threads"] == "all" and not any("cpu:" in c for c in cap.caveats)


def test_dataloader_workers_are_said_to_be_unseen() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    with memprof.capture() as cap:
        for _ in torch.utils.data.DataLoader(data, batch_size=4, num_workers=2):
            pass
    assert cap.meta["dataloader_workers"] == 2
    assert any("2 DataLoader worker process(es)" in c for c in cap.caveats)
    assert "DataLoader worker" in render("text", cap).splitlines()[1]
    assert any("DataLoader" in w for w in json.loads(render("table-json", cap))["warnings"])


# -- bounded captures ----------------------------------------------------------------------------

def test_a_capture_that_dropped_events_has_no_exact_peak() -> None:
    with memprof.capture(max_events=100) as cap:
        small = [torch.empty(10) for _ in range(110)]
        big = torch.empty(10_000_000)  # 40 MB, after the bound
    del small, big
    assert cap.dropped > 0 and not cap.exact
    with pytest.raises(IncompleteCaptureError, match="lower bound"):
        cap.peak()
    with pytest.raises(IncompleteCaptureError):
        cap.attribution()
    assert cap.peak(lower_bound=True) < 40_000_000
    text = render("text", cap).splitlines()
    assert text[1].startswith("  INCOMPLETE:") and "lower bound" in text[1]
    assert "at least" in text[2] and "≥" in text[3]
    table = render("table", cap, by="category")
    assert "lower bound" in table.splitlines()[0] and "INCOMPLETE" in table.splitlines()[1]
    doc = json.loads(render("table-json", cap, by="category"))
    assert doc["exact"] is False and doc["warnings"] and doc["caveats"]
    summary = json.loads(render("json", cap))
    assert summary["exact"] is False and summary["caveats"][0].startswith("INCOMPLETE")


def _six_steps_cut_after_four() -> memprof.Capture:
    """Six steps of alloc, free, marker (3 events each) into 13 events: 4 steps whole, step 5 cut.
    (With the cyclic collector off: earlier tests' garbage freed inside would be events too.)"""
    gc.collect()
    gc.disable()
    try:
        with memprof.capture(max_events=13, scopes="none") as cap:
            for _ in range(6):
                a = torch.empty(100)
                del a
                memprof.step()
    finally:
        gc.enable()
    return cap


def test_steps_before_the_first_drop_stay_exact() -> None:
    cap = _six_steps_cut_after_four()
    steps = cap.steps("cpu")
    assert [s.step for s in steps if s.complete] == [1, 2, 3, 4]  # 3 events a step: 4 steps and one event
    assert all(s.peak == 400 for s in steps if s.complete)
    assert not steps[-1].complete  # the step the drop cut
    assert "4 of the 6 steps were captured whole" in cap.caveats[0]


def test_max_events_on_the_command_line_says_incomplete_at_the_top(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import torch\nkeep = [torch.empty(100) for _ in range(300)]\nbig = torch.empty(1_000_000)\n")
    res = invoke_memprof("trace", "train.py", "--max-events", "200", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if not ln.startswith("  ") or "INCOMPLETE" in ln]
    assert "INCOMPLETE" in res.stderr.splitlines()[1], res.stderr
    assert "exact bytes" not in res.stderr, lines
    rep = invoke_memprof("report", "train.memprof", "--by", "category", cwd=tmp_path)
    assert rep.returncode == 0 and "INCOMPLETE" in rep.stdout.splitlines()[1]
    js = json.loads(invoke_memprof("report", "train.memprof", "--by", "category", "--json", cwd=tmp_path).stdout)
    assert js["exact"] is False and js["warnings"]


# -- one definition of a step ------------------------------------------------------------------

def test_step_peak_at_its_starting_level_agrees_with_attribution() -> None:
    with memprof.capture() as cap:
        a = torch.empty(1000)
        memprof.step()
        del a  # step 2 starts at 4000 B and never comes back to it
        b = torch.empty(100)
        memprof.step()
    del b
    steps = cap.steps("cpu")
    assert [(s.step, s.peak) for s in steps] == [(1, 4000), (2, 4000)]
    rows = cap.attribution(at="step:2")
    assert sum(r.bytes for r in rows) == 4000


def test_no_phantom_step_after_the_last_one(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "print(float(m.weight.sum()))\n")
    res = invoke_memprof("trace", "train.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    cap = memprof.load(tmp_path / "train.memprof")
    assert [s.step for s in cap.steps("cpu")] == [1, 2, 3]
    assert "3 steps:" in res.stderr


# -- outputs --------------------------------------------------------------------------------------

def test_an_output_is_never_an_input_or_another_output(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import torch\nx = torch.empty(10)\n")
    line = one_line_error(invoke_memprof("trace", "train.py", "-o", "same.memprof", "--chrome", "same.memprof",
                                      cwd=tmp_path))
    assert "same file" in line and not (tmp_path / "same.memprof").exists()
    assert "is the script" in one_line_error(invoke_memprof("trace", "train.py", "-o", "train.py", "--force",
                                                         cwd=tmp_path))
    assert invoke_memprof("trace", "train.py", "-o", "cap.memprof", cwd=tmp_path).returncode == 0
    (tmp_path / "cap.json").write_bytes((tmp_path / "cap.memprof").read_bytes())
    before = (tmp_path / "cap.json").read_bytes()
    line = one_line_error(invoke_memprof("export", "cap.json", "--force", cwd=tmp_path))
    assert "input capture" in line and (tmp_path / "cap.json").read_bytes() == before


def test_a_relative_output_does_not_follow_the_scripts_chdir(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "out.memprof").write_text("the user's file")
    (tmp_path / "train.py").write_text("import os, torch\nos.chdir('elsewhere')\nx = torch.empty(10)\n")
    res = run_memprof("trace", "train.py", "-o", "out.memprof", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "elsewhere" / "out.memprof").read_text() == "the user's file"
    assert memprof.load(tmp_path / "out.memprof").peak("cpu") == 40
    (tmp_path / "gone.py").write_text(
        "import os, tempfile, torch\nd = tempfile.mkdtemp()\nos.chdir(d)\nos.rmdir(d)\nx = torch.empty(10)\n")
    res = run_memprof("trace", "gone.py", "-o", "gone.memprof", cwd=tmp_path)
    assert res.returncode == 0 and "capture saved" in res.stderr, res.stderr
    assert memprof.load(tmp_path / "gone.memprof").peak("cpu") == 40


def test_two_traces_never_share_an_output(tmp_path: Path) -> None:
    """The first holds its spill's lock while it runs: the second is refused in one line naming the
    first's process, with --force too, and the first's spill and capture are untouched."""
    (tmp_path / "slow.py").write_text("import time, torch\nx = torch.empty(1000)\ntime.sleep(4)\n")
    (tmp_path / "quick.py").write_text("import torch\nx = torch.empty(10)\n")
    first = subprocess.Popen([sys.executable, "-m", "memprof", "trace", "slow.py", "-o", "run.memprof"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spill = tmp_path / "run.memprof.spill"
    deadline = time.monotonic() + 60
    while not spill.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for force in ((), ("--force",)):
        line = one_line_error(invoke_memprof("trace", "quick.py", "-o", "run.memprof", *force, cwd=tmp_path))
        assert "is being recorded now by another memprof" in line and f"pid {first.pid}" in line, line
    assert spill.exists()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert memprof.load(tmp_path / "run.memprof").peak("cpu") == 4000 and not spill.exists()


def test_a_file_the_script_writes_at_the_output_is_kept(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import torch\nx = torch.empty(10)\nopen('train.memprof', 'w').write('mine')\n"
        "open('t.json', 'w').write('mine too')\n")
    res = invoke_memprof("trace", "train.py", "--chrome", "t.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "train.memprof").read_text() == "mine" and (tmp_path / "t.json").read_text() == "mine too"
    assert "train.memprof appeared while the capture ran" in res.stderr
    assert "capture saved to train.1.memprof" in res.stderr and "written to t.1.json" in res.stderr
    assert memprof.load(tmp_path / "train.1.memprof").peak("cpu") == 40
    res = invoke_memprof("trace", "train.py", "--force", cwd=tmp_path)  # --force replaces it, as it says
    assert res.returncode == 0 and memprof.load(tmp_path / "train.memprof").peak("cpu") == 40


def test_the_api_refuses_an_existing_output_unless_told(tmp_path: Path) -> None:
    out = tmp_path / "run.memprof"
    out.write_text("a file of the user's")
    with pytest.raises(memprof.MemprofError, match="already exists: pass overwrite=True"), \
            memprof.capture(output=out):
        pass
    assert out.read_text() == "a file of the user's" and not memprof.recorder.active()
    with memprof.capture(output=out, overwrite=True) as cap:
        x = torch.empty(10)
    del x
    assert cap.saved_to == out and memprof.load(out).peak("cpu") == 40


def test_sweep_force_never_replaces_what_memprof_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "run.memprof").write_text("x")
    line = one_line_error(invoke_memprof("sweep", "train.py", "--budgets", "0.1", "-o", ".", "--force", cwd=tmp_path))
    assert "current directory" in line and (tmp_path / "train.py").exists() and (tmp_path / "run.memprof").exists()
    danger = tmp_path / "danger"
    (danger / "sub").mkdir(parents=True)
    for name in ("old.memprof", "keep.txt", "sub/results.csv"):
        (danger / name).write_text(name)
    line = one_line_error(invoke_memprof("sweep", "train.py", "--budgets", "0.1", "-o", "danger", "--force",
                                      cwd=tmp_path))
    assert "not written by memprof sweep" in line
    assert sorted(str(p.relative_to(danger)) for p in danger.rglob("*")) == [
        "keep.txt", "old.memprof", "sub", "sub/results.csv"]


def test_sweep_force_removes_only_the_files_its_manifest_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """A user's own captures and notes inside an earlier sweep's directory stay, even of the kinds a
    sweep writes: only the files the sweep listed go."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sw"
    prepare_dir(out, force=False)
    assert json.loads((out / MANIFEST).read_text())["files"] == ["sweep.json"]
    record_files(out, "stock_0.100.memprof", "logs/stock_0.100.log", "logs/stock_0.100.json", "sweep.png")
    for name in ("stock_0.100.memprof", "sweep.json", "sweep.png", "logs/stock_0.100.log", "logs/stock_0.100.json",
                 "notes.txt", "my_baseline.memprof", "logs/my_notes.json", "logs/mine.log"):
        (out / name).write_text("x")
    prepare_dir(out, force=True)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        MANIFEST, "logs", "logs/mine.log", "logs/my_notes.json", "my_baseline.memprof", "notes.txt"]
    (out / MANIFEST).write_text(json.dumps({"written_by": "memprof 0.1.0", "files": ["*.memprof", "logs/*.json"]}))
    with pytest.raises(memprof.MemprofError, match="earlier memprof"):
        prepare_dir(out, force=True)  # a manifest of patterns (an earlier memprof's) lists no files
    assert (out / "my_baseline.memprof").exists()
    # names outside the directory are never removed
    (out / MANIFEST).write_text(json.dumps({"version": 2, "files": ["../train.py", "/etc/passwd"]}))
    (tmp_path / "train.py").write_text("")
    prepare_dir(out, force=True)
    assert (tmp_path / "train.py").exists()
    script = out / "train.py"
    script.write_text("")
    with pytest.raises(memprof.MemprofError, match="holds the script"):
        prepare_dir(out, force=True, script=script)


def test_files_follow_the_umask(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import torch\nx = torch.empty(10)\n")
    for mask, mode in ((0o022, 0o644), (0o077, 0o600)):
        res = subprocess.run([sys.executable, "-m", "memprof", "trace", "train.py", "-o", f"u{mask:o}.memprof",
                              "--chrome", f"u{mask:o}.json"], cwd=tmp_path, capture_output=True, text=True,
                             preexec_fn=lambda m=mask: os.umask(m))  # type: ignore[misc]
        assert res.returncode == 0, res.stderr
        assert stat.S_IMODE((tmp_path / f"u{mask:o}.memprof").stat().st_mode) == mode
        assert stat.S_IMODE((tmp_path / f"u{mask:o}.json").stat().st_mode) == mode


def test_a_full_disk_keeps_the_summary_and_the_exit_code(tmp_path: Path) -> None:
    """A write that fails (here a file-size limit, as a full disk would): the summary is printed, one
    line says why the file could not be written, the script's exit code is kept, nothing partial stays."""
    (tmp_path / "train.py").write_text(
        "import sys, torch\nfor _ in range(20000):\n    t = torch.empty(4)\nsys.exit(5)\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    res = subprocess.run([sys.executable, "-m", "memprof", "trace", "train.py"], cwd=tmp_path,
                         capture_output=True, text=True, preexec_fn=limit)
    assert res.returncode == 5, res.stderr
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    assert "exact bytes" in res.stderr and "sys.exit(5)" in res.stderr  # the summary came first
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("memprof: error:")]
    assert len(errors) == 1 and "could not be written" in errors[0] and "train.memprof" in errors[0]
    assert res.stderr.splitlines()[-1] == errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


# -- signals --------------------------------------------------------------------------------------

def test_signals_while_saving_never_lose_the_capture(tmp_path: Path) -> None:
    """SIGTERMs keep coming from the script's end until after the save: the first ends the script,
    none of the rest interrupts stopping or writing the capture, which exists when memprof says so."""
    (tmp_path / "train.py").write_text(
        "import os, signal, threading, time, torch\n"
        "keep = [torch.empty(4) for _ in range(200_000)]\n"
        "def pester():\n"
        "    end = time.time() + 4\n"
        "    while time.time() < end:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(0.01)\n"
        "threading.Thread(target=pester, daemon=True).start()\n"
        "time.sleep(30)\n")
    res = run_memprof("trace", "train.py", cwd=tmp_path, timeout=120)
    # 143 once memprof is done; a SIGTERM that comes after memprof has written and said everything
    # may end the process with the default handler (-15): the capture is already on disk then
    assert res.returncode in (143, -signal.SIGTERM), res.stderr
    assert "saving the capture, please wait" in res.stderr
    saved = [ln for ln in res.stderr.splitlines() if "capture saved to" in ln]
    assert saved and res.stderr.index("terminated (SIGTERM)") < res.stderr.index(saved[0])
    cap = memprof.load(tmp_path / "train.memprof")
    assert cap.meta["status"] == "interrupted" and cap.peak("cpu") >= 200_000 * 16
    assert not list(tmp_path.glob(".*.tmp"))


def test_sighup_saves_the_capture(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import os, signal, torch\nx = torch.empty(100)\nos.kill(os.getpid(), signal.SIGHUP)\n")
    res = run_memprof("trace", "train.py", cwd=tmp_path)
    assert res.returncode == -signal.SIGHUP, res.stderr  # the process dies by it, as python's would
    cap = memprof.load(tmp_path / "train.memprof")
    assert cap.meta["status"] == "interrupted" and cap.meta["error"] == "SIGHUP" and cap.peak("cpu") == 400


# -- what memprof says about the script ----------------------------------------------------------

def test_syntax_error_shows_no_memprof_frame_and_exit_code_is_named(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("print(\n")
    res = invoke_memprof("trace", "bad.py", cwd=tmp_path)
    assert res.returncode == 1 and "SyntaxError" in res.stderr
    assert "runner.py" not in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "ex.py").write_text("import sys\nsys.exit(3)\n")
    res = invoke_memprof("trace", "ex.py", cwd=tmp_path)
    assert res.returncode == 3 and "the script called sys.exit(3)" in res.stderr


def test_interpreter_exit_with_an_open_capture_is_quiet(tmp_path: Path) -> None:
    code = "import torch, memprof\nctx = memprof.capture()\ncap = ctx.__enter__()\nx = torch.empty(100)\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr
    assert "memprof: warning: a capture was still open at interpreter exit" in res.stderr


def test_terminal_escapes_in_a_capture_are_not_printed_raw() -> None:
    with (memprof.capture(meta={"command": "evil \x1b]0;pwned\x07 \x1b[2J"}) as cap,
          torch.profiler.record_function("\x1b[31mred scope")):
        x = torch.empty(100)
    cap.meta["notes"].append("note \x1b[1mbold")
    for text in (render("text", cap), render("table", cap, by="kernel")):
        assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b" in render("text", cap)
    del x


def test_kernel_names_are_printed_whole() -> None:
    name = "triton_per_fused_add_mul_native_layer_norm_native_layer_norm_backward_pow_sum_0_extra_long"
    with memprof.capture(scopes="graphs") as cap, torch.profiler.record_function(name):
        x = torch.empty(100)
    assert name in render("table", cap, by="kernel")
    del x


def test_random_op_warning_names_memprofs_remat_pass() -> None:
    from memprof.analysis.summary import rng_warnings

    cap = memprof.load(Path(__file__).resolve().parents[1] / "fixtures" / "tiny_compiled.memprof")
    plan = cap.plans[0]
    import dataclasses

    cap.plans[0] = dataclasses.replace(plan, recomputed_random=["native_dropout"])
    (warning,) = rng_warnings(cap)
    assert "--remat light" in warning and "functionalize_rng_ops" in warning


def test_one_line_error_ignores_lines_that_are_not_memprofs() -> None:
    res = subprocess.CompletedProcess(["x"], 1, "", "UserWarning: torch says something\nmemprof: error: bad\n")
    assert one_line_error(res) == "memprof: error: bad"


def test_a_frame_dynamo_gave_up_on_is_said_to_run_eagerly() -> None:
    """Dynamo's recompile limit makes later calls run eagerly: the capture is exact, but of a program
    the user did not mean to run, and it says so next to the figure."""
    import torch._dynamo

    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), memprof.capture() as cap:
        for n in range(1, 6):
            fn(torch.randn(n))
    assert any("recompile_limit (2)" in c and "ran eagerly" in c for c in cap.caveats)
    assert "ran eagerly" in render("text", cap)


def test_a_table_at_the_step_a_capture_stopped_in_is_a_lower_bound() -> None:
    cap = _six_steps_cut_after_four()
    whole = json.loads(render("table-json", cap, by="category", at="step:4"))
    cut = json.loads(render("table-json", cap, by="category", at="step:5"))
    assert whole["exact"] is True and cut["exact"] is False
    assert "step:5 of the events kept (a lower bound)" in render("table", cap, by="category", at="step:5")


def test_a_forked_child_records_nothing() -> None:
    """A DataLoader worker is a fork of the capturing process: it inherits the session and must not
    record into its copy of it (nothing it does reaches the parent's capture anyway)."""
    import memprof._native

    with memprof.capture() as cap:
        x = torch.empty(100)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            torch.empty(1000)
            os.write(write, b"1" if memprof._native.native().active() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"0"
        os.close(read)
        os.close(write)
    assert cap.peak("cpu") == 400
    del x
