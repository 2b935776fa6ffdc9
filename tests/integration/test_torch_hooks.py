"""The seam to torch's internals: every replacement memprof makes is declared, and every one is
restored after a capture, a remat block or a prediction run, whatever order they end in."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import memprof
import memprof.remat
from memprof.torch_hooks.patch import TARGETS, Patches, current, resolve

ROOT = Path(__file__).resolve().parents[2]


def _state() -> dict[tuple[str, str], Any]:
    return {t: current(*t) for t in TARGETS}


def _assert_restored(before: dict[tuple[str, str], Any]) -> None:
    after = _state()
    changed = [f"{m}.{p}" for (m, p), v in before.items() if after[(m, p)] is not v]
    assert not changed, f"not restored: {changed}"


def _step(backend: str) -> None:
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    fn = torch.compile(model, backend=backend)
    fn(torch.randn(8, 16)).sum().backward()
    opt.step()


def test_every_target_resolves() -> None:
    for module, path in TARGETS:
        if path.startswith("AsyncCompile.cpp_pybinding"):
            continue  # not in every torch
        obj, name = resolve(module, path)
        assert hasattr(obj, name), f"{module}.{path}"


def test_an_undeclared_patch_is_refused() -> None:
    with pytest.raises(AssertionError, match="not a declared patch target"), Patches() as p:
        p.set("torch", "matmul", None)
    with pytest.raises(AssertionError, match="not a declared instance patch target"), Patches() as p:
        p.set_on(torch.ops.aten.mm, "_op", None)  # a packet, not an overload


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_capture_and_remat_restore_every_patched_symbol(backend: str) -> None:
    before = _state()
    with memprof.capture() as cap:
        _step(backend)
    assert cap.plans
    _assert_restored(before)
    with memprof.remat.enable("light"):
        _step(backend)
    _assert_restored(before)
    with memprof.remat.enable("light"), memprof.capture() as cap:
        _step(backend)
    assert cap.plans and cap.plans[0].remat is not None
    _assert_restored(before)


def test_blocks_ending_out_of_order_restore_everything() -> None:
    before = _state()
    remat_block = memprof.remat.enable("all")
    capture_block = memprof.capture()
    remat_block.__enter__()
    cap = capture_block.__enter__()
    _step("aot_eager")
    remat_block.__exit__(None, None, None)  # the remat block ends first, inside the capture
    _step("aot_eager")
    capture_block.__exit__(None, None, None)
    _assert_restored(before)
    assert [p.remat is not None for p in cap.plans] == [True, False]


def test_a_failing_partitioner_restores_everything() -> None:
    before = _state()
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("a partitioner that fails")

    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=broken)
    with pytest.raises(Exception, match="a partitioner that fails"), memprof.capture() as cap:
        torch._dynamo.reset()
        torch.compile(torch.nn.Linear(4, 4), backend=backend)(torch.randn(2, 4)).sum().backward()
    assert calls == [1]  # the broken partitioner ran inside memprof's chain, and its error came out
    assert cap.meta["status"] == "exception" and not memprof.active()
    _assert_restored(before)


def test_predict_restores_every_patched_symbol() -> None:
    from memprof.sweep.predict import predict

    before = _state()
    saved = sys.path[:]
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        torch._dynamo.reset()
        out = predict(str(ROOT / "tests" / "sweep_train.py"), ["--layers", "1", "--d", "32", "--seq", "16",
                                                           "--steps", "1"], [0.0, 1.0], None)
    finally:
        sys.path[:] = saved
    assert [o.status for o in out] == ["completed", "completed"]
    _assert_restored(before)


def test_the_compile_hooks_wait_for_the_first_compile(tmp_path: Path) -> None:
    """A capture does not import Dynamo and Inductor (about two seconds) before the script compiles:
    a script that never compiles never loads them, and one that compiles inside the capture still
    has its plans and wrapper code recorded; `torch.compile` is torch's own again afterwards."""
    import subprocess

    code = ("import sys, torch, memprof\n"
            "original = torch.compile\n"
            "with memprof.capture() as cap:\n"
            "    x = torch.empty(100)\n"
            "print('dynamo loaded:', 'torch._dynamo' in sys.modules)\n"
            "m = torch.nn.Linear(8, 8)\n"
            "with memprof.capture() as cap:\n"
            "    torch.compile(m)(torch.randn(4, 8)).sum().backward()\n"
            "print('plans:', len(cap.plans), 'graphs:', len(cap.graphs))\n"
            "print('restored:', torch.compile is original)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "dynamo loaded: False" in res.stdout
    assert "plans: 1 graphs: 2" in res.stdout and "restored: True" in res.stdout


def _split(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos()


def test_graph_breaks_are_named_where_they_happen() -> None:
    """Dynamo's own record of its graph breaks, read (not hooked) over the capture: each place once,
    with why, in the capture and its summary; a capture without one says nothing of them."""
    import inspect
    import os

    from memprof.reporters import render

    torch._dynamo.reset()
    before = torch.compile(_split, backend="eager")
    before(torch.randn(8))  # a break before the capture is not the capture's
    with memprof.capture() as quiet:
        torch.randn(8).sin()
    assert quiet.info.graph_breaks == () and "graph breaks" not in render("text", quiet)
    torch._dynamo.reset()
    with memprof.capture() as cap:
        for _ in range(2):  # compiled once: one place
            torch.compile(_split, backend="eager")(torch.randn(8))
    line = inspect.getsourcelines(_split)[1] + 2
    (said,) = cap.info.graph_breaks
    assert said.startswith(f"{os.path.relpath(__file__)}:{line} in _split: ")
    assert "graph_break" in said.split(": ", 1)[1]
    text = render("text", cap)
    assert "graph breaks: Dynamo compiled the code in parts, split at 1 place" in text and f"  {said}" in text
    torch._dynamo.reset()
