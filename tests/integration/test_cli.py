"""The CLI as a user runs it (subprocesses): argument handling, exit codes, saved captures, bad input."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memprof

from ..conftest import invoke_memprof, one_line_error, run_memprof

SCRIPT = """\
import sys, torch
print("ARGV", sys.argv[1:], __name__, flush=True)
keep = torch.empty(1 << 16)
if "--raise" in sys.argv:
    raise ValueError("boom from the script")
if "--oom" in sys.argv:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
if "--sleep" in sys.argv:
    print("SLEEPING", flush=True)
    import time
    time.sleep(60)
"""


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    p = tmp_path / "train.py"
    p.write_text(SCRIPT)
    return p


def test_arguments_reach_the_script_as_under_python(script: Path, tmp_path: Path) -> None:
    res = run_memprof("trace", script.name, "--budget", "0.05", "--lr", "3", "-o", "out.memprof", "--", "-o", "x",
                      "--force", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "ARGV ['--lr', '3', '-o', 'x', '--force'] __main__" in res.stdout
    cap = memprof.load(tmp_path / "out.memprof")
    assert cap.meta["budget"] == 0.05 and cap.meta["status"] == "completed"
    assert cap.peak("cpu") >= 4 << 16
    assert "peak" in res.stderr and "cpu" in res.stderr


def test_options_before_the_script_and_default_output(script: Path, tmp_path: Path) -> None:
    res = run_memprof("trace", "--budget", "0.3", script.name, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert memprof.load(tmp_path / "train.memprof").meta["budget"] == 0.3


def test_script_exception_keeps_the_capture(script: Path, tmp_path: Path) -> None:
    res = run_memprof("trace", script.name, "--raise", cwd=tmp_path)
    assert res.returncode == 1
    assert "ValueError: boom from the script" in res.stderr
    cap = memprof.load(tmp_path / "train.memprof")
    assert cap.meta["status"] == "exception" and cap.peak("cpu") >= 4 << 16


def test_out_of_memory_keeps_the_capture(script: Path, tmp_path: Path) -> None:
    res = run_memprof("trace", script.name, "--oom", cwd=tmp_path)
    assert res.returncode == 1
    assert memprof.load(tmp_path / "train.memprof").meta["status"] == "oom"


def test_sys_exit_code_is_passed_through(script: Path, tmp_path: Path) -> None:
    res = run_memprof("trace", script.name, "--exit", "7", cwd=tmp_path)
    assert res.returncode == 7
    assert memprof.load(tmp_path / "train.memprof").meta["exit_code"] == 7


def test_ctrl_c_saves_the_capture(script: Path, tmp_path: Path) -> None:
    # (SIGINT at its default: a test run in the background, as a CI job may be, inherits it ignored, and
    # memprof leaves an ignored SIGINT ignored as python does)
    proc = subprocess.Popen([sys.executable, "-m", "memprof", "trace", script.name, "--sleep"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    deadline = time.time() + 120
    while time.time() < deadline and "SLEEPING" not in proc.stdout.readline():
        pass
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT, err  # as python's own process ends (by the signal)
    assert "runner.py" not in err and "KeyboardInterrupt" in err
    cap = memprof.load(tmp_path / "train.memprof")
    assert cap.meta["status"] == "interrupted" and cap.peak("cpu") >= 4 << 16


def test_report_and_export(script: Path, tmp_path: Path) -> None:
    assert invoke_memprof("trace", script.name, cwd=tmp_path).returncode == 0
    rep = invoke_memprof("report", "train.memprof", cwd=tmp_path)
    assert rep.returncode == 0 and "peak" in rep.stdout
    js = invoke_memprof("report", "train.memprof", "--json", cwd=tmp_path)
    import json

    assert json.loads(js.stdout)["devices"][0]["device"] == "cpu"
    exp = invoke_memprof("export", "train.memprof", "--format", "chrome", cwd=tmp_path)
    assert exp.returncode == 0, exp.stderr
    from memprof.reporters.chrome import validate_chrome_trace

    assert validate_chrome_trace(json.loads((tmp_path / "train.json").read_text())) == []


def test_huge_pages_are_numpys_while_the_script_runs_and_off_for_memprofs_arrays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's huge pages (slow to fault in where the kernel compacts memory for them) are off for
    memprof's own arrays: while a capture is saved and summarized (then numpy's setting again), and
    in the commands that run no script; the script itself runs with numpy's setting."""
    import memprof.session
    from memprof._events import huge_pages

    numpy_get = "(getattr(numpy, '_core', None) or numpy.core).multiarray._get_madvise_hugepage"
    (tmp_path / "pages.py").write_text(f"import numpy, torch\nprint('HUGE', {numpy_get}())\nkeep = torch.empty(4)\n")
    saving: list[bool] = []  # the setting while the capture is saved (huge_pages(False) returns it, changing nothing)
    save = memprof.session._save
    monkeypatch.setattr(memprof.session, "_save", lambda *a: (saving.append(huge_pages(False)), save(*a))[1])
    before = huge_pages(True)
    try:
        traced = invoke_memprof("trace", "pages.py", cwd=tmp_path)
        assert saving == [False]
        assert traced.returncode == 0 and "HUGE True" in traced.stdout
        assert huge_pages(True) is True  # (restored after the save and the summary)
        assert invoke_memprof("report", "pages.memprof", cwd=tmp_path).returncode == 0
        assert huge_pages(True) is False
    finally:
        huge_pages(before)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trace", "missing.py"], "does not exist"),
        (["trace", "notes.txt"], "not a Python file"),
        (["trace", "train.py", "--budget", "abc"], "must be a number"),
        (["trace", "train.py", "--budget", "1.5"], "must be in [0, 1]"),
        (["trace", "train.py", "-o", "no/such/dir/x.memprof"], "does not exist"),
        (["trace", "train.py", "-o", "/proc/x.memprof"], "cannot write to output directory"),
        (["trace", "train.py", "-o", "exists.memprof"], "already exists; pass --force"),
        (["report", "exists.memprof"], "truncated or corrupt"),
        (["report", "missing.memprof"], "no such file"),
        (["export", "exists.memprof", "--format", "nope"], "nope"),
        # slips that get a pointer to what was meant
        (["report", "train.py"], "train.py is a Python script, not a capture: memprof trace train.py"),
        (["train.py"], "train.py is not a command: to trace a script, memprof trace train.py"),
        (["--budget", "0.1", "trace", "train.py"], "--budget is an option of memprof trace: put it after the command"),
        (["trace", "train.py", "-o", "exists.memprof"], "a -o of the script's own goes after --"),
        (["report", "/dev/zero"], "/dev/zero is not a regular file"),
    ],
)
def test_bad_input_is_one_line(script: Path, tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "exists.memprof").write_text("junk")
    line = one_line_error(invoke_memprof(*args, cwd=tmp_path))
    assert message in line


def test_missing_extension_says_how_to_build(script: Path, tmp_path: Path) -> None:
    code = ("import sys; sys.modules['memprof._C'] = None\n"
            "from memprof.cli import main; main(['trace', 'train.py'])")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    line = one_line_error(res)
    assert "native extension is not available" in line and "bash tools/setup.sh" in line


def test_profiler_already_active_is_one_line(tmp_path: Path) -> None:
    code = ("import torch\nfrom memprof.cli import main\n"
            "with torch.profiler.profile():\n    main(['trace', 'train.py'])")
    (tmp_path / "train.py").write_text("print('hi')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    # Kineto logs its own start/stop lines ("USDT: ... profiler_start"); those are not memprof's
    res.stderr = "\n".join(line for line in res.stderr.splitlines() if "USDT:" not in line)
    assert "torch.profiler is already active" in one_line_error(res)


def test_version_and_module_entry_point(tmp_path: Path) -> None:
    res = run_memprof("--version", cwd=tmp_path)
    assert res.returncode == 0 and memprof.__version__ in res.stdout
