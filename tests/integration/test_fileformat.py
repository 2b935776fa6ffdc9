"""The .memprof file: round trip, no pickle, refusal of bad files with one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import memprof
from memprof.errors import CaptureFileError


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[memprof.Capture, Path]:
    with memprof.capture(meta={"command": "unit test"}) as cap:
        a = torch.empty(1000)
        memprof.step()
        b = torch.empty(300)
        del a, b
    path = tmp_path_factory.mktemp("cap") / "unit.memprof"
    cap.save(path)
    return cap, path


def test_round_trip(saved: tuple[memprof.Capture, Path]) -> None:
    cap, path = saved
    back = memprof.load(path)
    assert np.array_equal(back.raw, cap.raw)
    assert back.strings == cap.strings
    assert back.peak("cpu") == cap.peak("cpu") == 4000 + 1200  # a is live when b is allocated
    assert back.meta["command"] == "unit test"
    assert back.meta["torch_version"] == torch.__version__
    assert [s.peak for s in back.steps("cpu")] == [4000]  # the events after the last marker are no step
    assert [s.peak for s in back.steps("cpu", tail=True)] == [4000, 5200]


def test_file_holds_no_pickle(saved: tuple[memprof.Capture, Path]) -> None:
    _, path = saved
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == ["events.npy", "meta.json", "plans.json", "strings.json", "threads.json"]
        header = zf.read("events.npy")[:128]
    assert b"'descr'" in header and b"'O'" not in header


def test_load_does_not_need_the_extension(saved: tuple[memprof.Capture, Path]) -> None:
    _, path = saved
    code = ("import sys; sys.modules['memprof._C'] = None; import memprof; "
            f"c = memprof.load({str(path)!r}); print(c.peak('cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5200"


def _rewrite(src: Path, dst: Path, **changes: bytes) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            zout.writestr(name, changes.get(name.replace(".", "_"), zin.read(name)))
    return dst


def test_truncated_file_is_refused(saved: tuple[memprof.Capture, Path], tmp_path: Path) -> None:
    _, path = saved
    bad = tmp_path / "trunc.memprof"
    bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CaptureFileError, match="truncated or corrupt"):
        memprof.load(bad)


def test_corrupt_events_are_refused(saved: tuple[memprof.Capture, Path], tmp_path: Path) -> None:
    _, path = saved
    bad = _rewrite(path, tmp_path / "corrupt.memprof", events_npy=b"\x93NUMPY garbage")
    with pytest.raises(CaptureFileError, match="corrupt"):
        memprof.load(bad)


def test_newer_format_is_refused(saved: tuple[memprof.Capture, Path], tmp_path: Path) -> None:
    _, path = saved
    with zipfile.ZipFile(path) as zf:
        meta = json.loads(zf.read("meta.json"))
    meta["format_version"] = 99
    bad = _rewrite(path, tmp_path / "newer.memprof", meta_json=json.dumps(meta).encode())
    with pytest.raises(CaptureFileError, match="newer memprof"):
        memprof.load(bad)


def test_not_a_capture_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "x.memprof"
    text.write_text("hello")
    with pytest.raises(CaptureFileError, match="truncated or corrupt"):
        memprof.load(text)
    other = tmp_path / "y.memprof"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("meta.json", json.dumps({"format": "something-else"}))
    with pytest.raises(CaptureFileError, match="not a memprof capture"):
        memprof.load(other)
    with pytest.raises(CaptureFileError, match="no such file"):
        memprof.load(tmp_path / "missing.memprof")


def test_errors_are_one_line(saved: tuple[memprof.Capture, Path], tmp_path: Path) -> None:
    _, path = saved
    bad = tmp_path / "t.memprof"
    bad.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CaptureFileError) as info:
        memprof.load(bad)
    assert "\n" not in str(info.value)
