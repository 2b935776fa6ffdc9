"""`memprof.capture(output=...)`: the capture is written however the block ends (the policy
`memprof trace` relies on), with the outcome in its metadata."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memprof


def _saved(path: Path) -> memprof.Capture:
    cap = memprof.load(path)
    assert cap.peak("cpu") >= 4000
    return cap


@pytest.mark.parametrize(("exc", "status", "code"), [
    (RuntimeError("boom"), "exception", 1),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom", 1),
    (SystemExit(3), "exit", 3),
    (KeyboardInterrupt(), "interrupted", 130),
])
def test_the_capture_is_saved_whatever_ends_the_block(tmp_path: Path, exc: BaseException, status: str,
                                                       code: int) -> None:
    out = tmp_path / "run.memprof"
    with pytest.raises(type(exc)), memprof.capture(output=out) as cap:
        keep = torch.empty(1000)
        raise exc
    del keep
    assert cap.saved_to == out.resolve()
    saved = _saved(out)
    assert (saved.meta["status"], saved.meta["exit_code"], saved.info.status) == (status, code, status)


def test_a_normal_end_is_completed_and_a_write_failure_is_a_save_error(tmp_path: Path) -> None:
    with memprof.capture(output=tmp_path / "ok.memprof"):
        keep = torch.empty(1000)
    assert _saved(tmp_path / "ok.memprof").meta["status"] == "completed"
    with pytest.raises(memprof.SaveError, match="could not be written"), \
            memprof.capture(output=tmp_path / "no" / "such" / "dir.memprof") as cap:
        keep = torch.empty(1000)
    del keep
    assert cap.peak("cpu") >= 4000 and cap.saved_to is None  # still filled, nothing partial left


def test_a_write_failure_never_hides_the_blocks_own_exception(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="the script's"), memprof.capture(output=tmp_path / "no" / "x.memprof"):
        raise RuntimeError("the script's")
    assert "memprof: error: the capture could not be written" in capsys.readouterr().err


def test_sigterm_saves_the_capture_then_ends_the_process_as_it_would(tmp_path: Path) -> None:
    code = ("import os, signal, time, torch, memprof\n"
            "with memprof.capture(output='run.memprof'):\n"
            "    keep = torch.empty(1000)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n"
            "print('not reached')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGTERM and "not reached" not in res.stdout, res.stderr
    cap = _saved(tmp_path / "run.memprof")
    assert cap.meta["status"] == "interrupted" and cap.meta["error"] == "SIGTERM"
