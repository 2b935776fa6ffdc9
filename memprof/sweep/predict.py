"""`memprof sweep --predict`: compile-time predictions of the step peak, with no training step.

Run as `python -m memprof.sweep.predict --budget B --json OUT [--budget B2 --json OUT2 ...]
[--remat MODE] SCRIPT -- ARGS` (the sweep starts one per group of budgets). The script runs under
memprof's compile hooks (no allocation capture) with
`torch._functorch.config.force_non_lazy_backward_lowering`, so each compiled region's backward is
partitioned and compiled together with its forward; the first call of `Tensor.backward` /
`torch.autograd.backward` then stops the script (a script that only calls `torch.autograd.grad`
runs to its end). What ran is the compile and one forward; no backward and no optimizer step. The
predictions are those of `memprof.sweep.measure.estimates` (memprof's walk of the wrapper code,
Inductor's estimate, the partitioner's KnapsackEvaluator).

No kernel is compiled. Inductor compiles every graph as usual, up to its wrapper code (which the
predictions read), but the script runs each compiled graph as its FX graph, op by op (`eager_runs`):
the forward needs its outputs, not its speed, and so no process spends time compiling its kernels.
Kernels are made lazy (`LazyKernel`), so that loading the wrapper code
compiles none; a graph whose op-by-op run fails falls back to its compiled code, whose kernels are
then compiled as they are first called.

Budgets differ only from the partitioner on, so the budgets of one process share everything before
it: the interpreter and imports, the script up to its compile, Dynamo's trace and AOTAutograd's
joint graph. At each compiled region (`aot_stage2_autograd`, AOTAutograd's partition-and-compile
stage), every budget after the first is partitioned and compiled on its own copy of the joint graph
(its compiled function is dropped, never run); then the first budget, which the script runs on
with. Inductor's joint-graph passes, which precede the partitioner, run for the first of these
compiles only; the others partition copies of their output (`_joint_passes_once`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memprof.errors import one_line


class _Stop(BaseException):
    """Raised at the first backward call: everything it needs has been compiled."""


class LazyKernel:
    """A kernel Inductor asked for, compiled at its first call (or attribute read) instead: in a
    prediction most are never called (the backward's, every kernel of the budgets compiled beside
    the one the script runs with)."""

    def __init__(self, compile_kernel: Callable[[], Any], name: str) -> None:
        self._compile = compile_kernel
        self._kernel: Any = None
        self.name = name

    @property
    def is_compiled(self) -> bool:
        return self._kernel is not None

    def kernel(self) -> Any:
        if self._kernel is None:
            k = self._compile()
            self._kernel = k.result() if callable(getattr(k, "result", None)) else k  # a pool's future
        return self._kernel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel()(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel().run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.kernel(), name)


@contextlib.contextmanager
def lazy_kernels(made: list[LazyKernel]) -> Iterator[None]:
    """Within: Inductor's kernel compilers (`AsyncCompile.triton`, `.cpp`, `.cpp_pybinding`) return a
    `LazyKernel`, compiled when first called; each is appended to `made`."""
    import functools

    from torch._inductor.async_compile import AsyncCompile

    def deferred(kind: str, compile_now: Callable[..., Any]) -> Callable[..., LazyKernel]:
        def compile_later(self: Any, *args: Any, **kwargs: Any) -> LazyKernel:
            name = args[0] if kind == "triton" and args and isinstance(args[0], str) else kind
            made.append(LazyKernel(functools.partial(compile_now, self, *args, **kwargs), str(name)))
            return made[-1]

        return compile_later

    kinds = [k for k in ("triton", "cpp", "cpp_pybinding") if k in AsyncCompile.__dict__]
    saved = {k: AsyncCompile.__dict__[k] for k in kinds}
    for k in kinds:
        setattr(AsyncCompile, k, deferred(k, saved[k]))
    try:
        yield
    finally:
        for k, f in saved.items():
            setattr(AsyncCompile, k, f)


def _graph_copy(gm: Any) -> Any:
    """A GraphModule copied as AOTAutograd copies its backward: nodes copied, their metadata shared."""
    import copy

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return copy.deepcopy(gm)


class EagerRun:
    """Runs a compiled graph as its FX graph, op by op (Inductor's boxed calling convention: one
    list of inputs, cleared once they are consumed); falls back to the compiled code if that fails."""

    def __init__(self, graph: Any, compiled: Callable[[list[Any]], Any], note: Callable[[str], None]) -> None:
        self.graph: Any = graph
        self.compiled = compiled
        self.note = note
        self.eager_calls = 0

    def __call__(self, inputs: list[Any]) -> Any:
        if self.graph is not None:
            try:
                out = self.graph(*inputs)
            except Exception as exc:
                self.note(f"a compiled graph ran its compiled code: its op-by-op run failed ({one_line(exc)})")
                self.graph = None
            else:
                self.eager_calls += 1
                inputs.clear()
                return out
        return self.compiled(inputs)


@contextlib.contextmanager
def eager_runs(made: list[EagerRun], note: Callable[[str], None]) -> Iterator[None]:
    """Within: each graph Inductor compiles (`_compile_fx_inner`, every pass and the code generation
    as usual) is run op by op by an `EagerRun` of its graph as given (copied before Inductor's passes
    change it in place), appended to `made`. A graph that cannot be copied runs its compiled code."""
    import torch._inductor.compile_fx as compile_fx

    inner = compile_fx._compile_fx_inner

    def compile_run_eager(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            eager = _graph_copy(gm)
        except Exception as exc:
            note(f"a compiled graph runs its compiled code: not copied ({one_line(exc)})")
            eager = None
        compiled: Any = inner(gm, example_inputs, *args, **kwargs)
        if eager is not None and callable(getattr(compiled, "current_callable", None)):
            made.append(EagerRun(eager, compiled.current_callable, note))
            compiled.current_callable = made[-1]
        return compiled

    compile_run_eager.__wrapped__ = inner  # type: ignore[attr-defined]
    compile_fx._compile_fx_inner = compile_run_eager
    try:
        yield
    finally:
        compile_fx._compile_fx_inner = inner


@dataclass
class _Book:
    """Which budget's compile recorded each plan, graph and kernel, and the seconds each one's took."""

    recorder: Any
    kernels: list[LazyKernel] = field(default_factory=list)
    eager: list[EagerRun] = field(default_factory=list)  # (only the budget the script runs with runs its graphs)
    plan_owner: dict[int, float] = field(default_factory=dict)
    graph_owner: dict[int, float] = field(default_factory=dict)
    kernel_owner: dict[int, float] = field(default_factory=dict)
    seconds: dict[float, float] = field(default_factory=dict)
    shared_seconds: float = 0.0  # within `compiling`, but work for every budget (the joint-graph passes)
    errors: dict[float, str] = field(default_factory=dict)

    @contextlib.contextmanager
    def compiling(self, budget: float) -> Iterator[None]:
        plans, graphs, kernels = len(self.recorder.plans), len(self.recorder.graphs), len(self.kernels)
        t0, shared = time.perf_counter(), self.shared_seconds
        try:
            yield
        finally:
            own = time.perf_counter() - t0 - (self.shared_seconds - shared)
            self.seconds[budget] = self.seconds.get(budget, 0.0) + own
            self.plan_owner.update(dict.fromkeys(range(plans, len(self.recorder.plans)), budget))
            self.graph_owner.update(dict.fromkeys(range(graphs, len(self.recorder.graphs)), budget))
            self.kernel_owner.update(dict.fromkeys(range(kernels, len(self.kernels)), budget))

    def kernel_counts(self, budget: float) -> tuple[int, int]:
        """(kernels this budget's compile asked for, of which compiled: those the script called)."""
        mine = [k for i, k in enumerate(self.kernels) if self.kernel_owner.get(i) == budget]
        return len(mine), sum(k.is_compiled for k in mine)


def _copies(aot_state: Any, capture: Any) -> tuple[Any, Any]:
    """An AOTState and AOTGraphCapture for one more partition of the same joint graph: the graph
    copied as AOTAutograd copies its backward (node metadata shared, not copied), the metadata's
    containers copied (partitioning writes into them), the inputs' lists copied."""
    import copy
    import dataclasses

    gm = _graph_copy(capture.graph_module)
    args = capture.updated_flat_args
    args = tuple(list(a) for a in args) if isinstance(args, tuple) else list(args)
    meta = copy.copy(aot_state.fw_metadata)
    for k, v in vars(meta).items():
        if isinstance(v, dict | list | set):
            object.__setattr__(meta, k, copy.copy(v))
    return dataclasses.replace(aot_state, fw_metadata=meta), dataclasses.replace(capture, graph_module=gm,
                                                                                 updated_flat_args=args)


def sharing_available() -> bool:
    """Whether this torch has the stage that several budgets can share a process through."""
    try:
        import torch._functorch._aot_autograd.graph_compile as graph_compile
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        return False
    return callable(getattr(graph_compile, "aot_stage2_autograd", None)) and hasattr(AsyncCompile, "triton")


def _share_joint_graph(book: _Book, first: float, others: Sequence[float]) -> Callable[[], None]:
    """Patch AOTAutograd's partition-and-compile stage to compile `others` before `first`; returns
    the undo."""
    import torch._functorch._aot_autograd.graph_compile as graph_compile
    import torch._functorch.config as functorch_config

    original = graph_compile.aot_stage2_autograd

    # torch 2.11: (aot_state, aot_graph_capture); 2.13 adds partition_fn, fw_compiler, bw_compiler
    def stage2(aot_state: Any, capture: Any, *rest: Any, **kwargs: Any) -> Any:
        with _joint_passes_once(book, reuse=bool(others)) as next_budget:
            for b in others:
                if b in book.errors:
                    continue  # failed in an earlier region: its prediction is lost anyway
                next_budget()
                with book.compiling(b):
                    try:
                        state, cap = _copies(aot_state, capture)
                        with functorch_config.patch(activation_memory_budget=b):
                            original(state, cap, *rest, **kwargs)
                    except Exception as exc:
                        book.errors[b] = one_line(exc)
            next_budget()
            with book.compiling(first):
                return original(aot_state, capture, *rest, **kwargs)

    graph_compile.aot_stage2_autograd = stage2  # type: ignore[assignment]
    return lambda: setattr(graph_compile, "aot_stage2_autograd", original)


@contextlib.contextmanager
def _joint_passes_once(book: _Book, reuse: bool) -> Iterator[Callable[[], None]]:
    """Within (one compiled region, its budgets in turn): Inductor's joint-graph passes run for the
    first budget only; every later one gets a copy of what they made, call by call (the same joint
    graph, and passes that do not depend on the budget; with `reuse` False, one budget alone, nothing
    is kept). Yields `next_budget`, called before each budget. The passes' seconds go to
    `book.shared_seconds`, not to the budget that ran them."""
    import torch._inductor.compile_fx as compile_fx

    passes = compile_fx._recursive_joint_graph_passes
    made: list[Any] = []  # the first budget's outputs, in call order (copies: its partitioner changes them)
    state = {"call": 0, "depth": 0}

    def next_budget() -> None:
        state["call"] = 0

    def joint_passes_once(gm: Any, *args: Any, **kwargs: Any) -> Any:
        if state["depth"]:  # a subgraph, inside the passes of its graph
            return passes(gm, *args, **kwargs)
        i = state["call"]
        state["call"] += 1
        t0 = time.perf_counter()
        try:
            if i < len(made):
                return _graph_copy(made[i])
            state["depth"] += 1
            try:
                out = passes(gm, *args, **kwargs)
            finally:
                state["depth"] -= 1
            if reuse and i == len(made):
                made.append(_graph_copy(out))
            return out
        finally:
            book.shared_seconds += time.perf_counter() - t0

    joint_passes_once.__wrapped__ = passes  # type: ignore[attr-defined]
    compile_fx._recursive_joint_graph_passes = joint_passes_once
    try:
        yield next_budget
    finally:
        compile_fx._recursive_joint_graph_passes = passes


def predict(script: Path, args: list[str], budgets: Sequence[float], remat: str | None) -> list[dict[str, Any]]:
    """One result per budget (the JSON each writes), in the order given; the first budget is the
    one the script runs with."""
    import dataclasses

    import torch
    import torch._functorch.config as functorch_config

    from memprof.compile_hooks import PlanRecorder
    from memprof.runner import run_script
    from memprof.sweep.measure import estimate_fields, estimates, merge_facts, plan_facts

    if not budgets:
        raise ValueError("no budget to predict")
    first, others = budgets[0], list(budgets[1:])
    sharing = sharing_available()
    if others and not sharing:
        raise RuntimeError("this torch has no AOTAutograd stage to share between budgets: predict one per process")
    notes: list[str] = []
    functorch_config.activation_memory_budget = first
    functorch_config.force_non_lazy_backward_lowering = True
    recorder = PlanRecorder(time.perf_counter_ns, notes.append, knapsack_evaluator=True)
    book = _Book(recorder)
    originals = (torch.Tensor.backward, torch.autograd.backward)

    def stop(*_a: Any, **_k: Any) -> Any:
        raise _Stop()

    t0 = time.perf_counter()
    with contextlib.ExitStack() as undo:  # undone in reverse
        if remat:
            from memprof.remat import enable

            undo.enter_context(enable(remat))
        recorder.install()
        undo.callback(recorder.uninstall)
        if sharing:  # (with no stage to share, one budget alone still runs, its compile timed as a whole)
            undo.callback(_share_joint_graph(book, first, others))
        undo.enter_context(lazy_kernels(book.kernels))
        undo.enter_context(eager_runs(book.eager, notes.append))
        # not torch.autograd.grad: AOTAutograd traces the joint graph with it
        torch.Tensor.backward = stop  # type: ignore[method-assign]
        torch.autograd.backward = stop
        undo.callback(setattr, torch.Tensor, "backward", originals[0])
        undo.callback(setattr, torch.autograd, "backward", originals[1])
        result = run_script(script, args, stop=_Stop)
    total = time.perf_counter() - t0
    shared = total - sum(book.seconds.values())  # the script, Dynamo, the joint graph: every budget's
    ok = result.status in ("stopped", "completed", "exit") and result.exit_code == 0
    out: list[dict[str, Any]] = []
    for b in budgets:
        # this budget's plans (renumbered) and graphs, and what no budget's stage compiled (inference graphs)
        keep = [i for i in range(len(recorder.plans)) if book.plan_owner.get(i, b) == b]
        renumber = {old: new for new, old in enumerate(keep)}
        plans = [dataclasses.replace(recorder.plans[i], index=renumber[i]) for i in keep]
        graphs = [dataclasses.replace(g, plan=renumber.get(g.plan) if g.plan is not None else None)
                  for j, g in enumerate(recorder.graphs) if book.graph_owner.get(j, b) == b]
        error = book.errors.get(b)
        kernels, compiled = book.kernel_counts(b)
        device = "cuda" if any("empty_strided_cuda" in g.source for g in graphs) else "cpu"
        found, walk = estimates(plans, graphs, device) if error is None else ({}, None)
        explained = estimate_fields(walk)
        facts = merge_facts([plan_facts(p) for p in plans]) if error is None else None
        if error is not None:
            status, code = "exception", 1
        elif not ok:  # a later region may be missing: every budget of the process shares the script's end
            status, code = result.status, result.exit_code or 1
            error = result.error if b == first else f"{result.error or result.status} (the script, run with {first:g})"
        else:
            status, code = "completed", 0
        out.append({
            "meta": {"status": status, "exit_code": code, "error": error, "budget": b, "remat": remat or "off",
                     "stopped_at_backward": result.status == "stopped", "group": list(budgets),
                     "ran_script": b == first, "kernels": kernels, "kernels_compiled": compiled,
                     "graphs_run_op_by_op": sum(1 for e in book.eager if e.eager_calls) if b == first else 0},
            "measured": {
                "device": device, "step_peak": None, "compiled": bool(plans), "plans": len(plans),
                "facts": None if facts is None else facts.__dict__, "estimates": found,
                # what this budget alone would take: its own partition and compile, and the shared part
                "compile_s": round(shared + book.seconds.get(b, 0.0), 2),
                "own_compile_s": round(book.seconds.get(b, 0.0), 2), "shared_s": round(shared, 2),
                "notes": notes, "step_ms": None, "buffer_level": bool(graphs),
                # no capture: what is live at the peak is memprof's estimate's (the step's own allocations)
                "at_peak": explained["estimate_at_peak"], "peak_phase": explained["estimate_peak_phase"],
                "at_peak_source": "estimate", **explained,
            },
        })
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memprof.sweep.predict")
    p.add_argument("--budget", type=float, action="append", required=True,
                   help="a budget to predict (repeatable; the first is the one the script runs with)")
    p.add_argument("--json", action="append", required=True, help="where each budget's result goes, in order")
    p.add_argument("--remat", default=None)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    if len(ns.json) != len(ns.budget):
        p.error(f"{len(ns.budget)} --budget but {len(ns.json)} --json")
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    results = predict(Path(ns.script), args, ns.budget, ns.remat)
    for path, out in zip(ns.json, results, strict=True):
        Path(path).write_text(json.dumps(out))
        m, meta = out["measured"], out["meta"]
        if meta["status"] != "completed":
            print(f"memprof: budget {meta['budget']:g} not predicted ({meta['status']}): {meta['error']}",
                  file=sys.stderr)
            continue
        print(f"memprof: predicted budget {meta['budget']:g}: {m['estimates']} "
              f"({m['own_compile_s']:.1f} s own compile, {m['shared_s']:.1f} s shared)", file=sys.stderr)
    return 0 if all(r["meta"]["status"] == "completed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
