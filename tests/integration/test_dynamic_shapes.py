"""memprof never changes what Dynamo compiles: on dynamic-shape scripts, the number of graphs and the
shape guards are the same with and without a capture (plan recording reads symbolic sizes from their
hints, never `int()` on a SymInt)."""

from __future__ import annotations

from typing import Any

import pytest
import sympy
import torch

import memprof
from memprof.torch_hooks.fx import size_hint


def _train(backend: str, mode: str) -> tuple[int, list[str]]:
    """A small training loop whose sequence length changes every step; returns Dynamo's graph count and
    every shape guard of the compiled frames (what decides recompiles)."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    envs: list[Any] = []
    inner = lookup_backend(backend)

    def recording_backend(gm: Any, example_inputs: Any) -> Any:
        envs.append(torch._guards.TracingContext.get().fake_mode.shape_env)
        return inner(gm, example_inputs)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    compiled = torch.compile(model, backend=recording_backend, dynamic=True if mode == "dynamic" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for length in range(3, 9):
        x = torch.randn(2, length, 8)
        if mode == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 1)
        compiled(x).sum().backward()
        opt.step()
        opt.zero_grad()
    # simplified: a guard's printed form can depend on what sympy has cached (`2*s50 <= 4096` for
    # `s50 <= 2048`), its meaning cannot
    guards = sorted(str(sympy.simplify(g.expr)) for env in envs for g in env.guards)
    return int(counters["stats"]["unique_graphs"]), guards


@pytest.mark.parametrize(("backend", "mode"), [
    ("aot_eager", "varying_length"), ("aot_eager", "mark_dynamic"), ("aot_eager", "dynamic"),
    ("inductor", "varying_length"),
])
def test_capture_adds_no_guard_and_no_recompile(backend: str, mode: str) -> None:
    plain = _train(backend, mode)
    with memprof.capture() as cap:
        captured = _train(backend, mode)
    assert captured == plain
    assert plain[0] <= 2  # one static graph at most, then one dynamic graph for every length
    assert cap.plans, "the plans of the dynamic graphs are still recorded"
    symbolic = [n for p in cap.plans for n in p.forward.nodes if n.size_expr]
    assert symbolic and all(n.bytes is None and n.shape is None for n in symbolic)
    rows = cap.attribution(at="peak", by="node", device="cpu")
    assert sum(r.bytes for r in rows) == cap.peak("cpu")
    if backend == "inductor":  # every call of the dynamic graph joined to its buffers, sizes checked per call
        calls = cap.labels("cpu").calls
        assert calls and all(c.level == "buffer" for c in calls), [c.reason for c in calls]
        from memprof.sweep.measure import estimates

        assert estimates(cap.plans, cap.graphs, "cpu")[0]["memprof"] is None  # no sizes to add up: no figure


def test_capture_under_remat_adds_no_guard() -> None:
    plain = _train("aot_eager", "mark_dynamic")
    with memprof.remat.enable("light"), memprof.capture():
        captured = _train("aot_eager", "mark_dynamic")
    assert captured[0] == plain[0] and captured[1] == plain[1]


def test_size_hint_reads_a_symbolic_size_without_a_guard() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env) as mode:
        t = mode.from_tensor(torch.empty(4, 10), symbolic_context=None)
        from torch._dynamo.source import ConstantSource
        sym = env.create_symintnode(env.create_symbol(10, ConstantSource("L")), hint=10)
        n = t.new_empty(4, sym)
    assert size_hint(n.numel() * n.element_size()) == 160
    assert size_hint(7) == 7
    assert env.guards == []
