"""`memprof trace SCRIPT ARGS` runs the script exactly as `python SCRIPT ARGS` does (issue 28): its
arguments in order and form, its `__file__` and loader, the signal dispositions the shell left and
how signals act on it, its exception hook, forked children, its threads at the end, closed standard
streams; and the capture still sees what happens (threads that outlive the main code, forks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import memprof
from memprof.cli.args import split_command

from ..conftest import invoke_memprof, run_memprof

ARGV = "import sys\nprint(repr(sys.argv))\n"


def _both(tmp_path: Path, script: str, *args: str, memprof_args: tuple[str, ...] = ("--force",),
          preexec: Callable[[], None] | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str],
                                                                                    subprocess.CompletedProcess[str]]:
    """The script run by `python` and by `python -m memprof trace` (its options before SCRIPT), as a
    parent process sees each: exit status (negative: the signal that ended it), stdout, stderr."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    plain = subprocess.run([sys.executable, script, *args], cwd=tmp_path, capture_output=True, text=True,
                           env=env, preexec_fn=preexec, timeout=timeout)
    traced = subprocess.run([sys.executable, "-m", "memprof", "trace", *memprof_args, script, *args], cwd=tmp_path,
                            capture_output=True, text=True, env=env, preexec_fn=preexec, timeout=timeout)
    return plain, traced


# -- 1. arguments ------------------------------------------------------------------------------------

def test_the_split_rule() -> None:
    takes, flags = {"--budget", "-o", "--output", "--steps"}, {"--force"}
    split = split_command(["--budget", "0.1", "s.py", "--steps", "100", "sub", "-o", "x", "--lr=1"], takes, flags)
    assert (split.before, split.script, split.script_args, split.taken) == (
        ["--budget", "0.1"], "s.py", ["--steps", "100", "sub", "--lr=1"], ["-o", "x"])
    assert split_command(["s.py", "x", "--", "y"], takes, flags).script_args == ["x", "y"]
    assert split_command(["s.py", "x", "--", "--", "y"], takes, flags).script_args == ["x", "--", "y"]
    verbatim = split_command(["--", "s.py", "x", "--budget", "1", "--", "y"], takes, flags)
    assert (verbatim.script, verbatim.script_args, verbatim.taken) == ("s.py", ["x", "--budget", "1", "--", "y"], [])
    window = split_command(["s.py", "--steps", "3:5", "--steps=9", "--budget=0.2", "-h"], takes, flags)
    assert (window.script_args, window.taken) == (["--steps=9", "-h"], ["--steps", "3:5", "--budget=0.2"])
    # an option of two values (fit's --scale ARG VALUES) takes both, whatever the first looks like
    two = split_command(["--scale", "--batch={}", "8:64", "s.py", "--scale", "--seq={}", "1,2", "x"],
                        {*takes, "--scale"}, flags, nargs={"--scale": 2})
    assert (two.before, two.script, two.script_args, two.taken) == (
        ["--scale", "--batch={}", "8:64"], "s.py", ["x"], ["--scale", "--seq={}", "1,2"])


def test_the_script_gets_its_arguments_in_order_and_form(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(ARGV)
    for args in (["--steps", "100", "train", "--lr", "0.1", "-x"], ["a", "--", "b", "--steps=3"], []):
        plain, traced = _both(tmp_path, "./s.py", *args, memprof_args=("--force", "--"))
        assert traced.returncode == plain.returncode == 0, traced.stderr
        assert traced.stdout == plain.stdout, (args, traced.stdout)
    assert "['./s.py'" in plain.stdout


def test_an_argparse_subcommand_script_runs_with_memprofs_options_after_it(tmp_path: Path) -> None:
    (tmp_path / "cli.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\nsub = p.add_subparsers(dest='cmd', required=True)\n"
        "t = sub.add_parser('train')\nt.add_argument('--steps', type=int)\nprint(p.parse_args())\n")
    res = invoke_memprof("trace", "cli.py", "train", "--budget", "0.05", "--steps", "100", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    head = res.stderr.splitlines()[0]
    assert "memprof took --budget 0.05 from after the script" in head and "activation_memory_budget=0.05" in head
    res = run_memprof("trace", "cli.py", "train", "--steps", "100", "-o", "c.memprof", cwd=tmp_path)
    assert res.returncode == 0 and "Namespace(cmd='train', steps=100)" in res.stdout, res.stderr
    assert "memprof took -o c.memprof from after the script" in res.stderr.splitlines()[0]
    assert memprof.load(tmp_path / "c.memprof").meta["argv"] == ["cli.py", "train", "--steps", "100"]


def test_an_output_taken_from_after_the_script_says_how_to_give_it_to_the_script(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(ARGV)
    (tmp_path / "mine.txt").write_text("the script's file")
    res = invoke_memprof("trace", "s.py", "-o", "mine.txt", cwd=tmp_path)
    assert res.returncode == 1 and "a -o of the script's own goes after --" in res.stderr
    assert (tmp_path / "mine.txt").read_text() == "the script's file"


# -- 2. the main module ---------------------------------------------------------------------------

def test_file_and_loader_are_pythons_and_source_is_found_after_chdir(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.py").write_text(
        "import os, sys, inspect, tempfile, torch\n"
        "def f(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
        "print(__file__, os.path.isabs(__file__), sys._getframe().f_code.co_filename == __file__)\n"
        "print(type(__loader__).__name__, __spec__, __package__, __cached__, sys.path[0])\n"
        "os.chdir(tempfile.gettempdir())\n"
        "print(os.path.abspath(__file__) == __file__, len(inspect.getsource(f)) > 0)\n"
        "print(torch.jit.script(f)(torch.ones(1)).item())\n")
    plain, traced = _both(tmp_path, "sub/m.py")
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert traced.stdout == plain.stdout
    assert "SourceFileLoader" in traced.stdout and "2.0" in traced.stdout


# -- 3-5. signals ---------------------------------------------------------------------------------

def _ignore(*signals: int) -> Callable[[], None]:
    def preexec() -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
    return preexec


def test_signals_the_shell_ignores_stay_ignored(tmp_path: Path) -> None:
    """Under nohup (SIGHUP ignored) and as a background job (SIGINT ignored) the signals do nothing,
    and signal.getsignal() answers as under python."""
    (tmp_path / "s.py").write_text(
        "import os, signal, time\n"
        "print([str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)])\n"
        "os.kill(os.getpid(), signal.SIGHUP)\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nprint('alive')\n")
    plain, traced = _both(tmp_path, "s.py", preexec=_ignore(signal.SIGHUP, signal.SIGINT))
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert traced.stdout == plain.stdout and "alive" in traced.stdout
    plain, traced = _both(tmp_path, "s.py")  # and with nothing ignored: SIGHUP ends both
    assert plain.returncode == traced.returncode == -signal.SIGHUP
    assert traced.stdout == plain.stdout
    assert memprof.load(tmp_path / "s.memprof").meta["error"] == "SIGHUP"


def test_sigterm_acts_as_under_python_and_the_capture_is_saved(tmp_path: Path) -> None:
    """A bare except cannot swallow SIGTERM, finally blocks do not run, the process dies by it, and
    the capture (with what was live) is saved and reported."""
    (tmp_path / "s.py").write_text(
        "import os, signal, time, torch\nkeep = torch.empty(1_000_000)\n"
        "for attempt in range(3):\n"
        "    try:\n        os.kill(os.getpid(), signal.SIGTERM)\n        time.sleep(5)\n"
        "    except:\n        print('swallowed')\n    finally:\n        print('finally')\n"
        "print('survived')\n")
    plain, traced = _both(tmp_path, "s.py")
    assert plain.returncode == traced.returncode == -signal.SIGTERM
    assert plain.stdout == traced.stdout == ""
    assert "terminated (SIGTERM); saving the capture" in traced.stderr and "capture saved" in traced.stderr
    assert not (tmp_path / "s.memprof.spill").exists()  # saved: the spill has done its job
    cap = memprof.load(tmp_path / "s.memprof")
    assert cap.meta["status"] == "interrupted" and cap.meta["error"] == "SIGTERM" and cap.exact
    assert cap.peak("cpu") == 4_000_000


def test_a_process_a_signal_ends_dies_by_it(tmp_path: Path) -> None:
    (tmp_path / "kbd.py").write_text("import torch\nx = torch.empty(10)\nraise KeyboardInterrupt\n")
    plain, traced = _both(tmp_path, "kbd.py")
    assert plain.returncode == traced.returncode == -signal.SIGINT
    assert "KeyboardInterrupt" in traced.stderr and "capture saved" in traced.stderr
    assert memprof.load(tmp_path / "kbd.memprof").meta["status"] == "interrupted"
    (tmp_path / "term.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    plain, traced = _both(tmp_path, "term.py")
    assert plain.returncode == traced.returncode == -signal.SIGTERM


def test_a_scripts_own_handler_runs_and_getsignal_answers_it(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(
        "import os, signal, sys\n"
        "def h(n, f):\n    print('handled', n); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, h)\nprint(signal.getsignal(signal.SIGTERM) is h)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n")
    plain, traced = _both(tmp_path, "s.py")
    assert plain.returncode == traced.returncode == 7
    assert traced.stdout == plain.stdout == "True\nhandled 15\n"


# -- 6-9 ------------------------------------------------------------------------------------------

def test_the_scripts_excepthook_runs(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(
        "import sys\ndef hook(t, v, tb):\n    print('HOOK', t.__name__, v)\nsys.excepthook = hook\n"
        "raise ValueError('boom')\n")
    plain, traced = _both(tmp_path, "s.py")
    assert plain.returncode == traced.returncode == 1
    assert traced.stdout == plain.stdout == "HOOK ValueError boom\n"
    assert "Traceback" not in traced.stderr


def test_a_forked_child_exits_as_it_says(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(
        "import os, sys, torch\nx = torch.empty(1000)\npid = os.fork()\n"
        "if pid == 0:\n    torch.empty(10)\n    sys.exit(4)\n"
        "_, status = os.waitpid(pid, 0)\nprint('child', os.waitstatus_to_exitcode(status))\n")
    plain, traced = _both(tmp_path, "s.py")
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert traced.stdout == plain.stdout == "child 4\n"
    assert "internal error" not in traced.stderr and traced.stderr.count("capture saved") == 1
    cap = memprof.load(tmp_path / "s.memprof")
    assert cap.meta["child_processes"] == 1 and cap.peak("cpu") == 4000


def test_joining_every_other_thread_does_not_wait_for_memprof(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(
        "import threading, torch\nx = torch.empty(10)\n"
        "for t in threading.enumerate():\n    if t is not threading.main_thread():\n        t.join()\n"
        "print(threading.active_count())\n")
    plain, traced = _both(tmp_path, "s.py", timeout=60)
    assert plain.returncode == traced.returncode == 0 and traced.stdout == plain.stdout


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_closing_a_standard_stream_changes_nothing(tmp_path: Path, stream: str) -> None:
    (tmp_path / "s.py").write_text(f"import sys, torch\nx = torch.empty(10)\nprint('hi')\nsys.{stream}.close()\n")
    plain, traced = _both(tmp_path, "s.py")
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert traced.stdout == plain.stdout
    assert "internal error" not in traced.stderr and "capture saved" in traced.stderr


# -- 10-11: what the capture sees -----------------------------------------------------------------

def test_a_thread_that_outlives_the_main_code_is_captured(tmp_path: Path) -> None:
    """Python waits for non-daemon threads before it exits; memprof saves after them."""
    (tmp_path / "s.py").write_text(
        "import threading, time, torch\n"
        "def late():\n    time.sleep(0.5)\n    x = torch.empty(12_500_000)\n    time.sleep(0.1)\n"
        "threading.Thread(target=late).start()\nprint('main done')\n")
    plain, traced = _both(tmp_path, "s.py")
    assert plain.returncode == traced.returncode == 0 and traced.stdout == plain.stdout
    cap = memprof.load(tmp_path / "s.memprof")
    assert cap.exact and cap.peak("cpu") == 50_000_000


def test_a_forked_child_never_writes_the_parents_spill(tmp_path: Path) -> None:
    """The child unwinds through memprof's frames (sys.exit): it must not flush into the spill the
    parent writes, so the run recovered after a kill counts the parent's block once."""
    (tmp_path / "s.py").write_text(
        "import os, signal, sys, time, torch\nx = torch.empty(2_100_000)\ntime.sleep(1.5)\npid = os.fork()\n"
        "if pid == 0:\n    sys.exit(0)\nos.waitpid(pid, 0)\ntime.sleep(1.0)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    res = run_memprof("trace", "s.py", cwd=tmp_path)
    assert res.returncode == -signal.SIGKILL
    cap = memprof.load(tmp_path / "s.memprof")
    assert cap.info.recovered_from and cap.peak("cpu", lower_bound=True) == 8_400_000
