"""A hostile trial of memprof, as a demanding user would run it: each attempt runs a small script, a
command or a crafted file and checks one promise (the program runs as under `python`; a figure
called exact is exact; no file is lost or clobbered; hostile files cost what real ones do; errors
point the way). Prints a table of attempts tried, held and broken per category, then each broken
one. CPU only; about 10 minutes on 2 cores.

    python tools/trust_trial.py [-k SUBSTRING] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_compiled.memprof"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass
class Attempt:
    category: str
    name: str
    run: Callable[[Path], str | None]  # None: held; else what broke


def _py(cwd: Path, args: list[str], preexec: Callable[[], None] | None = None, stdin: str | None = None,
        timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, env=ENV,
                          preexec_fn=preexec, input=stdin, timeout=timeout)


def _write(cwd: Path, name: str, text: str) -> str:
    (cwd / name).write_text(textwrap.dedent(text))
    return name


def same_as_python(script: str, *args: str, memprof_args: tuple[str, ...] = ("--force",),
                   preexec: Callable[[], None] | None = None, stdin: str | None = None,
                   check: Callable[[Path, subprocess.CompletedProcess[str]], str | None] | None = None
                   ) -> Callable[[Path], str | None]:
    """The script under `python` and under `memprof trace`: the same exit status and stdout."""
    def attempt(cwd: Path) -> str | None:
        name = _write(cwd, "s.py", script)
        plain = _py(cwd, [name, *args], preexec, stdin)
        traced = _py(cwd, ["-m", "memprof", "trace", *memprof_args, name, *args], preexec, stdin)
        if plain.returncode != traced.returncode:
            return f"exit {traced.returncode} under memprof, {plain.returncode} under python: {traced.stderr[-300:]}"
        if plain.stdout != traced.stdout:
            return f"stdout differs: {traced.stdout[-200:]!r} against {plain.stdout[-200:]!r}"
        memprofs_traceback = "Traceback (most recent call last)" in traced.stderr and "Traceback" not in plain.stderr
        if "internal error" in traced.stderr or memprofs_traceback:
            return f"memprof said: {traced.stderr[-300:]}"
        return check(cwd, traced) if check is not None else None
    return attempt


def _load(cwd: Path, name: str = "s.memprof") -> object:
    import memprof

    return memprof.load(cwd / name)


def _ignore(*sigs: int) -> Callable[[], None]:
    return lambda: [signal.signal(s, signal.SIG_IGN) for s in sigs] and None  # type: ignore[func-returns-value]


# -- the program runs as under python -------------------------------------------------------------

ARGV = "import sys\nprint(sys.argv)\n"


def _argv0(cwd: Path) -> str | None:
    _write(cwd, "s.py", ARGV)
    plain = _py(cwd, ["./s.py", "a"])
    traced = _py(cwd, ["-m", "memprof", "trace", "--force", "./s.py", "a"])
    return None if plain.stdout == traced.stdout else f"{traced.stdout!r} against {plain.stdout!r}"


def _argv_rule(cwd: Path, after_trace: list[str], want: list[str]) -> str | None:
    _write(cwd, "s.py", ARGV)
    res = _py(cwd, ["-m", "memprof", "trace", "--force", *after_trace])
    got = res.stdout.strip()
    return None if got == str(["s.py", *want]) else f"sys.argv {got} (want {['s.py', *want]})"


def _taken_named(cwd: Path) -> str | None:
    _write(cwd, "s.py", ARGV)
    res = _py(cwd, ["-m", "memprof", "trace", "s.py", "--budget", "0.05", "--force"])
    head = res.stderr.splitlines()[0] if res.stderr else ""
    return None if "memprof took --budget 0.05 --force from after the script" in head else head[:200]


PROGRAM = [
    ("argv: a script's --steps 100", same_as_python(ARGV, "--steps", "100", "x", memprof_args=("--force", "--"))),
    ("argv: ./s.py stays ./s.py", _argv0),
    ("argv: options and values in order", same_as_python(ARGV, "-a", "1", "--b=2", "c", "-d",
                                                          memprof_args=("--force", "--"))),
    ("argv: a script's -- via -- --", lambda cwd: _argv_rule(cwd, ["s.py", "x", "--", "--", "y"],
                                                             ["x", "--", "y"])),
    ("argv: -- before SCRIPT", lambda cwd: _argv_rule(cwd, ["--", "s.py", "x", "--budget", "1"],
                                                      ["x", "--budget", "1"])),
    ("argv: memprof's options named on the first line", _taken_named),
    ("argparse subcommand with --steps", same_as_python(
        "import argparse\np = argparse.ArgumentParser()\ns = p.add_subparsers(dest='c', required=True)\n"
        "t = s.add_parser('train')\nt.add_argument('--steps', type=int)\nprint(p.parse_args())\n",
        "train", "--steps", "100")),
    ("__file__ absolute, loader, sys.path[0]", same_as_python(
        "import os, sys\nprint(os.path.isabs(__file__), type(__loader__).__name__, __spec__, sys.path[0],\n"
        "      sys._getframe().f_code.co_filename == __file__, sorted(globals()))\n")),
    ("torch.jit.script after os.chdir", same_as_python(
        "import os, tempfile, torch\ndef f(x: torch.Tensor) -> torch.Tensor:\n    return x + 1\n"
        "os.chdir(tempfile.gettempdir())\nprint(torch.jit.script(f)(torch.zeros(1)).item())\n")),
    ("nohup: SIGHUP ignored", same_as_python(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGHUP)\ntime.sleep(0.2)\nprint('alive')\n",
        preexec=_ignore(signal.SIGHUP))),
    ("background job: SIGINT ignored", same_as_python(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nprint('alive')\n",
        preexec=_ignore(signal.SIGINT))),
    ("getsignal answers as under python", same_as_python(
        "import signal\nprint([str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)])\n")),
    ("SIGTERM: a bare except cannot swallow it", same_as_python(
        "import os, signal, time\nfor i in range(3):\n    try:\n        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(2)\n    except:\n        print('swallowed')\nprint('survived')\n",
        check=lambda cwd, res: None if _load(cwd).meta["error"] == "SIGTERM" else "capture not saved")),  # type: ignore[attr-defined]
    ("SIGTERM: no finally runs", same_as_python(
        "import os, signal, time\ntry:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(2)\n"
        "finally:\n    print('finally')\n")),
    ("raise KeyboardInterrupt ends by SIGINT", same_as_python("raise KeyboardInterrupt\n")),
    ("self-sent SIGTERM ends by SIGTERM", same_as_python("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")),
    ("self-sent SIGHUP ends by SIGHUP", same_as_python("import os, signal\nos.kill(os.getpid(), signal.SIGHUP)\n")),
    ("the script's own SIGTERM handler", same_as_python(
        "import os, signal, sys\ndef h(n, f):\n    print('handled'); sys.exit(7)\nsignal.signal(signal.SIGTERM, h)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n")),
    ("sys.excepthook runs", same_as_python(
        "import sys\nsys.excepthook = lambda t, v, tb: print('HOOK', v)\nraise ValueError('x')\n")),
    ("a failing excepthook shows both", same_as_python(
        "import sys\ndef h(t, v, tb):\n    raise RuntimeError('hook')\nsys.excepthook = h\nraise ValueError('x')\n")),
    ("forked child sys.exit(4)", same_as_python(
        "import os, sys\npid = os.fork()\nif pid == 0:\n    sys.exit(4)\n_, s = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(s))\n")),
    ("join every other thread", same_as_python(
        "import threading\nfor t in threading.enumerate():\n    if t is not threading.main_thread():\n"
        "        t.join()\nprint(threading.active_count(), [t.name for t in threading.enumerate()])\n")),
    ("sys.stdout.close()", same_as_python("import sys\nprint('x')\nsys.stdout.close()\n")),
    ("sys.stderr.close()", same_as_python("import sys\nprint('x')\nsys.stderr.close()\n")),
    ("sys.exit forms", same_as_python("import sys\nsys.exit('a message')\n")),
    ("exit codes", same_as_python("import sys\nsys.exit(42)\n")),
    ("atexit", same_as_python("import atexit\natexit.register(lambda: print('bye'))\nprint('hi')\n")),
    ("stdin", same_as_python("import sys\nprint(sys.stdin.read().upper())\n", stdin="hello\n")),
    ("asyncio", same_as_python("import asyncio\nasync def m():\n    await asyncio.sleep(0.01)\n    return 3\n"
                               "print(asyncio.run(m()))\n")),
    ("a non-daemon thread runs to its end", same_as_python(
        "import threading, time\ndef t():\n    time.sleep(0.3); print('thread done')\n"
        "threading.Thread(target=t).start()\nprint('main done')\n")),
    ("ThreadPoolExecutor left open", same_as_python(
        "from concurrent.futures import ThreadPoolExecutor\nex = ThreadPoolExecutor(2)\n"
        "print(ex.submit(lambda: 5).result())\n")),
    ("pickle of a __main__ class", same_as_python(
        "import pickle\nclass A:\n    pass\nprint(type(pickle.loads(pickle.dumps(A()))).__name__)\n")),
    ("multiprocessing spawn pool", same_as_python(
        "import multiprocessing as mp\ndef sq(x):\n    return x * x\nif __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(2) as p:\n        print(p.map(sq, range(4)))\n")),
]


# -- a figure called exact is exact -----------------------------------------------------------

def _traced(cwd: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    name = _write(cwd, "s.py", script)
    return _py(cwd, ["-m", "memprof", "trace", "--force", name, *args])


def _peak_is(script: str, want: int, exact: bool = True) -> Callable[[Path], str | None]:
    def attempt(cwd: Path) -> str | None:
        res = _traced(cwd, script)
        cap = _load(cwd)
        got = cap.peak("cpu", lower_bound=True)  # type: ignore[attr-defined]
        if got != want or cap.exact is not exact:  # type: ignore[attr-defined]
            return f"peak {got:,} exact={cap.exact} (want {want:,} exact={exact}); {res.stderr[-200:]}"  # type: ignore[attr-defined]
        return None
    return attempt


def _forked_spill(cwd: Path) -> str | None:
    _traced(cwd, "import os, signal, sys, time, torch\nx = torch.empty(2_100_000)\ntime.sleep(1.5)\n"
                 "pid = os.fork()\nif pid == 0:\n    sys.exit(0)\nos.waitpid(pid, 0)\ntime.sleep(1)\n"
                 "os.kill(os.getpid(), signal.SIGKILL)\n")
    got = _load(cwd).peak("cpu", lower_bound=True)  # type: ignore[attr-defined]
    return None if got == 8_400_000 else f"recovered peak {got:,} (the block is 8,400,000 B)"


def _window_same(cwd: Path) -> str | None:
    script = (ROOT / "tests" / "integration" / "test_step_windows.py").read_text()
    loop = script.split('COMPILED_LOOP = """\\\n', 1)[1].split('"""', 1)[0]
    name = _write(cwd, "loop.py", loop)
    for out, extra in (("full", []), ("win", ["--steps", "4:6"]), ("ring", ["--keep-last", "3"])):
        res = _py(cwd, ["-m", "memprof", "trace", name, "-o", f"{out}.memprof", "--force", *extra])
        if res.returncode:
            return res.stderr[-300:]
    full = _load(cwd, "full.memprof")
    for part_name, steps in (("win.memprof", [4, 5, 6]), ("ring.memprof", [6, 7, 8])):
        part = _load(cwd, part_name)
        for step in steps:
            for by in ("category", "node"):
                a = sorted((r.key, r.bytes) for r in full.attribution(at=f"step:{step}", by=by))  # type: ignore[attr-defined]
                b = sorted((r.key, r.bytes) for r in part.attribution(at=f"step:{step}", by=by))  # type: ignore[attr-defined]
                if a != b:
                    return f"{part_name} step {step} by {by} differs"
    return None


EXACT = [
    ("a thread allocating after the main code", _peak_is(
        "import threading, time, torch\ndef t():\n    time.sleep(0.4); x = torch.empty(12_500_000); time.sleep(0.1)\n"
        "threading.Thread(target=t).start()\n", 50_000_000)),
    ("a forked child's copy never writes the spill", _forked_spill),
    ("frees on another thread", _peak_is(
        "import threading, torch\nkeep = [torch.empty(250_000) for _ in range(4)]\n"
        "t = threading.Thread(target=keep.clear)\nt.start(); t.join()\ny = torch.empty(250_000)\n", 4_000_000)),
    ("a compiled loop's window and ring equal the full capture", _window_same),
    ("max_events drop is a lower bound", lambda cwd: None if not _load_after(
        cwd, "import torch\nk = [torch.empty(10) for _ in range(500)]\n", "--max-events", "100").exact else "exact"),
]


def _load_after(cwd: Path, script: str, *args: str) -> object:
    _traced(cwd, script, *args)
    return _load(cwd)


# -- no file is lost or clobbered ----------------------------------------------------------------

def _two_at_once(cwd: Path) -> str | None:
    _write(cwd, "slow.py", "import time, torch\nx = torch.empty(1000)\ntime.sleep(4)\n")
    _write(cwd, "quick.py", "import torch\nx = torch.empty(10)\n")
    first = subprocess.Popen([sys.executable, "-m", "memprof", "trace", "slow.py", "-o", "r.memprof"], cwd=cwd,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.monotonic() + 60
    while not (cwd / "r.memprof.spill").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second = _py(cwd, ["-m", "memprof", "trace", "quick.py", "-o", "r.memprof", "--force"])
    first.wait(timeout=120)
    if second.returncode == 0 or "being recorded now" not in second.stderr:
        return f"second run: {second.returncode} {second.stderr[-200:]}"
    return None if _load(cwd, "r.memprof").peak("cpu") == 4000 else "the first run's capture was replaced"  # type: ignore[attr-defined]


def _script_writes_output(cwd: Path) -> str | None:
    _write(cwd, "s.py", "open('s.memprof', 'w').write('mine')\nimport torch\nx = torch.empty(10)\n")
    _py(cwd, ["-m", "memprof", "trace", "s.py"])  # (no --force: with it, memprof replaces the file, as asked)
    if (cwd / "s.memprof").read_text() != "mine":
        return "the script's file was overwritten"
    return None if (cwd / "s.1.memprof").exists() else "the capture went nowhere"


def _sweep_force(cwd: Path) -> str | None:
    _write(cwd, "s.py", "import torch\nx = torch.empty(10)\n")
    first = _py(cwd, ["-m", "memprof", "sweep", "s.py", "--budgets", "0.5", "-o", "sw", "--no-plot"])
    if first.returncode:
        return first.stderr[-200:]
    (cwd / "sw" / "my_baseline.memprof").write_text("mine")
    (cwd / "sw" / "logs" / "my_notes.json").write_text("{}")
    _py(cwd, ["-m", "memprof", "sweep", "s.py", "--budgets", "0.5", "-o", "sw", "--force", "--no-plot"])
    kept = (cwd / "sw" / "my_baseline.memprof").exists() and (cwd / "sw" / "logs" / "my_notes.json").exists()
    return None if kept else "the user's files in the sweep directory were removed"


def _api_overwrite(cwd: Path) -> str | None:
    _write(cwd, "s.py", "import memprof, torch\nwith memprof.capture(output=__file__):\n    x = torch.empty(10)\n")
    before = (cwd / "s.py").read_text()
    res = _py(cwd, ["s.py"])
    if (cwd / "s.py").read_text() != before:
        return "the running script was overwritten"
    return None if "overwrite=True" in res.stderr else res.stderr[-200:]


def _kill9(cwd: Path) -> str | None:
    _write(cwd, "s.py", "import time, torch\nk = []\nfor i in range(200_000):\n    k.append(torch.empty(8))\n"
                       "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-m", "memprof", "trace", "s.py", "--force"], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.monotonic() + 120
    spill = cwd / "s.memprof.spill"
    while (not spill.exists() or spill.stat().st_size < 4_000_000) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    cap = _load(cwd)
    return None if cap.info.recovered_from and cap.peak("cpu", lower_bound=True) > 0 else "nothing recovered"  # type: ignore[attr-defined]


def _full_disk(cwd: Path) -> str | None:
    _write(cwd, "s.py", "import sys, torch\nfor _ in range(20000):\n    t = torch.empty(4)\nsys.exit(5)\n")
    res = _py(cwd, ["-m", "memprof", "trace", "s.py", "--force"],
              preexec=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10)))
    return None if res.returncode == 5 and "could not be written" in res.stderr else res.stderr[-200:]


FILES = [
    ("two traces to one output", _two_at_once),
    ("the script writes the output path", _script_writes_output),
    ("sweep --force keeps the user's files", _sweep_force),
    ("capture(output=__file__)", _api_overwrite),
    ("kill -9 leaves a spill that recovers", _kill9),
    ("a full disk keeps the exit code", _full_disk),
]


# -- hostile files ---------------------------------------------------------------------------------

def _members() -> dict[str, bytes]:
    with zipfile.ZipFile(FIXTURE) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in members.items():
            zf.writestr(n, d)
    return path


def _meta(**changes: object) -> Callable[[Path], Path]:
    def make(cwd: Path) -> Path:
        m = _members()
        meta = json.loads(m["meta.json"])
        meta.update(changes)
        m["meta.json"] = json.dumps(meta).encode()
        return _zip(cwd / "h.memprof", m)
    return make


def _events(change: Callable[[np.ndarray], None], n: int | None = None) -> Callable[[Path], Path]:
    def make(cwd: Path) -> Path:
        sys.path.insert(0, str(ROOT))
        from memprof._events import EVENT_DTYPE

        m = _members()
        raw = np.load(io.BytesIO(m["events.npy"])).copy()
        if n is not None:
            raw = np.zeros(n, dtype=EVENT_DTYPE)
            raw["t_ns"] = json.loads(m["meta.json"])["t_start_ns"] + np.arange(n)
            raw["device_type"] = raw["device_index"] = -1
            m.pop("plans.json")
            m = {k: v for k, v in m.items() if not k.startswith("wrappers/")}
        change(raw)
        buf = io.BytesIO()
        np.save(buf, raw)
        m["events.npy"] = buf.getvalue()
        return _zip(cwd / "h.memprof", m)
    return make


def _refused(make: Callable[[Path], Path], words: str, seconds: float = 10.0, mb: float = 1500
             ) -> Callable[[Path], str | None]:
    """`memprof report` refuses (or flags) the file in one line, within the time and memory given."""
    def attempt(cwd: Path) -> str | None:
        path = make(cwd)
        t0 = time.perf_counter()
        res = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "memprof", "report", str(path)],
                             capture_output=True, text=True, env=ENV, timeout=max(60, 6 * seconds))
        wall = time.perf_counter() - t0
        peak_mb = int(res.stderr.strip().splitlines()[-1]) / 1024 if res.stderr.strip() else 0
        said = res.stdout + res.stderr
        if words not in said:
            return f"did not say {words!r}: {said[-200:]!r}"
        if "Traceback" in said or "internal error" in said:
            return said[-200:]
        if wall > seconds or peak_mb > mb:
            return f"took {wall:.1f} s and {peak_mb:.0f} MB"
        return None
    return attempt


def _stored_huge(cwd: Path) -> Path:
    m = _members()
    path = cwd / "h.memprof"
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in m.items():
            zf.writestr(n, d, zipfile.ZIP_STORED if n == "events.npy" else zipfile.ZIP_DEFLATED)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("events.npy")
    local = data.find(b"PK\x03\x04", info.header_offset)
    central = data.find(b"PK\x01\x02")
    while data[central + 46: central + 56] != b"events.npy":
        central = data.find(b"PK\x01\x02", central + 4)
    import struct

    for at in (local + 18, central + 20):
        struct.pack_into("<II", data, at, 3_760_000_000, 3_760_000_000)
    path.write_bytes(bytes(data))
    return path


def _many_members(cwd: Path) -> Path:
    m = _members()
    for k in range(300):
        m[f"wrappers/x{k}.py"] = b"#" * (900 << 10)
    return _zip(cwd / "h.memprof", m)


def _fifo(cwd: Path) -> Path:
    os.mkfifo(cwd / "f.memprof")
    return cwd / "f.memprof"


def _rank_world(cwd: Path) -> Path:
    m = _members()
    meta = json.loads(m["meta.json"])
    meta["distributed"] = {"rank": 0, "world_size": 10**12, "local_rank": 0, "node": 0, "run_id": "x"}
    m["meta.json"] = json.dumps(meta).encode()
    _zip(cwd / "run.rank0.memprof", m)
    return cwd / "run.memprof"


def _live_allocs(raw: np.ndarray) -> None:
    raw["kind"], raw["bytes"], raw["device_type"] = 0, 64, 0
    raw["ptr"] = np.arange(len(raw)) * 64 + 4096


def _unmatched(raw: np.ndarray) -> None:
    half = len(raw) // 2
    raw["kind"][:half], raw["kind"][half:] = 2, 3
    raw["scope"][:half], raw["scope"][half:] = 1, 2
    raw["kind"][-1], raw["bytes"][-1], raw["ptr"][-1], raw["device_type"][-1] = 0, 4096, 4096, 0


def _moved_frees(cwd: Path) -> Path:
    path = _events(lambda raw: raw["ptr"].__setitem__(np.flatnonzero(raw["kind"] == 1)[:3], 0xDEAD0000))(cwd)
    m = {}
    with zipfile.ZipFile(path) as zf:
        m = {n: zf.read(n) for n in zf.namelist()}
    meta = json.loads(m["meta.json"])
    meta["first_in_process"] = True
    m["meta.json"] = json.dumps(meta).encode()
    return _zip(cwd / "h2.memprof", m)


HOSTILE = [
    ("STORED events.npy declaring 3.76 GB", _refused(_stored_huge, "compressed bytes in a file of", 3, 300)),
    ("many members each within its slack", _refused(_many_members, "its members declare", 3, 300)),
    ("rank file with world_size 10**12", _refused(_rank_world, "distributed is not", 5, 400)),
    ("report /dev/zero", _refused(lambda cwd: Path("/dev/zero"), "is not a regular file", 5, 300)),
    ("report a FIFO", _refused(_fifo, "is not a regular file", 5, 300)),
    ("baselines of 10**40", _refused(_meta(baselines={"cpu": {"allocated": 10**40, "reserved": 0}}), "baselines", 5)),
    ("preexisting of 10**40", _refused(_meta(preexisting={"cuda:0": [[1, 10**40]]}), "preexisting", 5)),
    ("t_start_ns 10**30", _refused(_meta(t_start_ns=10**30), "t_start_ns", 5)),
    ('window ["a", "b"]', _refused(_meta(window=["a", "b"]), "window", 5)),
    ("a NaN budget", _refused(_meta(budget=float("nan")), "activation_memory_budget is nan", 5)),
    ("negative allocation sizes", _refused(_events(lambda r: r["bytes"].__setitem__(
        np.flatnonzero(r["kind"] == 0)[:5], -4096)), "allocations are positive", 5)),
    ("events in reverse time order", _refused(_events(lambda r: r["t_ns"].__setitem__(
        slice(None), r["t_ns"][::-1].copy())), "stored in time order", 5)),
    ("timestamps near the int64 minimum", _refused(_events(lambda r: r["t_ns"].__setitem__(
        0, np.iinfo(np.int64).min + 5)), "steady clock's range", 5)),
    ("frees of pointers never allocated", _refused(_moved_frees, "INCONSISTENT", 5)),
    ("2.5M live allocations (a 10 MB file)", _refused(_events(_live_allocs, 2_500_000), "memprof:", 15, 1200)),
    ("2.5M unmatched scope ends", _refused(_events(_unmatched, 2_500_000), "memprof:", 15, 1200)),
]


# -- errors point the way ---------------------------------------------------------------------------

def _says(args: list[str], words: str) -> Callable[[Path], str | None]:
    def attempt(cwd: Path) -> str | None:
        _write(cwd, "train.py", "print('hi')\n")
        (cwd / "exists.memprof").write_text("x")
        res = _py(cwd, ["-m", "memprof", *args])
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("memprof")]
        return None if res.returncode and lines and words in lines[0] else f"{res.returncode}: {res.stderr[-200:]}"
    return attempt


ERRORS = [
    ("report train.py", _says(["report", "train.py"], "is a Python script, not a capture: memprof trace")),
    ("memprof train.py", _says(["train.py"], "not a command: to trace a script, memprof trace train.py")),
    ("memprof --budget 0.1 trace", _says(["--budget", "0.1", "trace", "train.py"], "put it after the command")),
    ("existing -o from after the script", _says(["trace", "train.py", "-o", "exists.memprof"],
                                                "a -o of the script's own goes after --")),
]

CATEGORIES: dict[str, list[tuple[str, Callable[[Path], str | None]]]] = {
    "the program runs as under python": PROGRAM, "a figure called exact is exact": EXACT,
    "no file lost or clobbered": FILES, "hostile and odd files": HOSTILE, "errors point the way": ERRORS,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", default="", help="run only attempts whose name holds this")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    base = Path(args.workdir or tempfile.mkdtemp(prefix="memprof-trial-"))
    rows, broken = [], []
    for category, attempts in CATEGORIES.items():
        held = tried = 0
        for name, run in attempts:
            if args.k not in name:
                continue
            tried += 1
            cwd = base / f"{len(broken)}-{tried}-{category[:8].replace(' ', '_')}"
            cwd.mkdir(parents=True, exist_ok=True)
            try:
                why = run(cwd)
            except Exception as exc:  # the trial itself failed: counted as broken, with why
                why = f"{type(exc).__name__}: {exc}"
            held += why is None
            print(f"{'held  ' if why is None else 'BROKEN'} {category}: {name}" + (f": {why}" if why else ""),
                  flush=True)
            if why is not None:
                broken.append((category, name, why))
        rows.append((category, tried, held, tried - held))
    print(f"\n{'category':<36} {'tried':>6} {'held':>6} {'broken':>7}")
    for category, tried, held, bad in rows:
        print(f"{category:<36} {tried:>6} {held:>6} {bad:>7}")
    print(f"{'all':<36} {sum(r[1] for r in rows):>6} {sum(r[2] for r in rows):>6} {sum(r[3] for r in rows):>7}")


if __name__ == "__main__":
    main()
