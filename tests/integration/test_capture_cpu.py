"""Integration tests of the capture on real torch (CPU): exact bytes, backward, compiled steps."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import memprof
from memprof._events import Kind
from memprof.analysis.labels import Category
from memprof.reporters import render

from ..conftest import run_memprof


def cpu_alloc_events(cap: memprof.Capture) -> np.ndarray:
    ev = cap.events
    return ev[((ev["kind"] == "alloc") | (ev["kind"] == "free")) & (ev["device"] == "cpu")]


def test_known_pattern_is_captured_to_the_byte() -> None:
    sizes = [1 << 10, 3 << 12, 1 << 20]
    with memprof.capture() as cap:
        tensors = [torch.empty(n, dtype=torch.float32) for n in sizes]
        ptrs = [t.data_ptr() for t in tensors]
        del tensors[1]
        extra = torch.empty(5, dtype=torch.float64)
        extra_ptr = extra.data_ptr()
        del extra
    mem = cpu_alloc_events(cap)
    allocs = [(int(e["ptr"]), int(e["bytes"])) for e in mem if e["kind"] == "alloc"]
    frees = [(int(e["ptr"]), int(e["bytes"])) for e in mem if e["kind"] == "free"]
    assert allocs == [(ptrs[0], 4 << 10), (ptrs[1], 4 * (3 << 12)), (ptrs[2], 4 << 20), (extra_ptr, 40)]
    assert frees == [(ptrs[1], -4 * (3 << 12)), (extra_ptr, -40)]
    assert all(e["scope"] == "aten::empty" for e in mem if e["kind"] == "alloc")
    assert all(e["scope"] == "" for e in mem if e["kind"] == "free")  # `del` runs no op
    assert cap.peak("cpu") == (4 << 10) + 4 * (3 << 12) + (4 << 20)
    live = cap.live_at_peak("cpu")
    assert sum(a.bytes for a in live) == cap.peak("cpu")
    assert [a.bytes for a in live] == sorted((a.bytes for a in live), reverse=True)


def test_event_times_are_the_steady_clocks() -> None:
    """Events are timed on CLOCK_MONOTONIC (`time.monotonic_ns`), whether memprof reads it or the TSC
    mapped to it (where the kernel's clocksource is the TSC): each allocation lies between the clock's
    readings around it, 0.3 s apart, within 20 us (the rate's error over 0.3 s included)."""
    import time

    around = []
    with memprof.capture() as cap:
        for _ in range(2):
            before = time.monotonic_ns()
            torch.empty(1000)
            around.append((before, time.monotonic_ns()))
            time.sleep(0.3)
    times = [int(t) for t in cap.raw["t_ns"][cap.raw["kind"] == Kind.ALLOC]]
    assert len(times) == 2
    for t, (before, after) in zip(times, around, strict=True):
        assert before - 20_000 <= t <= after + 20_000, (t - before, after - t)


def test_backward_allocations_and_frees_are_captured() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 48)
    x = torch.randn(16, 96, requires_grad=True)
    with memprof.capture() as cap:
        lin(x).square().sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    mem = cpu_alloc_events(cap)
    by_ptr = {int(e["ptr"]): e for e in mem if e["kind"] == "alloc"}
    w = by_ptr[lin.weight.grad.data_ptr()]
    assert w["bytes"] == 48 * 96 * 4
    assert "Backward" in w["scope"] or w["scope"].startswith("aten::")
    assert by_ptr[x.grad.data_ptr()]["bytes"] == 16 * 96 * 4
    # the activation saved for backward (16x48 output of the linear layer) is freed by backward
    act = [e for e in mem if e["kind"] == "alloc" and e["bytes"] == 16 * 48 * 4]
    freed = {int(e["ptr"]) for e in mem if e["kind"] == "free"}
    assert any(int(e["ptr"]) in freed for e in act)
    scopes = set(cap.events["scope"])
    assert any(s.startswith("autograd::engine::evaluate_function") for s in scopes)


def test_compiled_step_peak_equals_largest_running_sum() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = torch.compile(model)
    x = torch.randn(128, 64)
    with memprof.capture() as cap:
        for _ in range(3):
            step(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    # CPU bytes count from the capture start: frees of tensors allocated before it (reported when
    # an earlier capture in this process saw them allocated) do not count
    running, peak, live = 0, 0, set()
    for e in cpu_alloc_events(cap):
        if e["bytes"] > 0:
            live.add(int(e["ptr"]))
        elif int(e["ptr"]) in live:
            live.discard(int(e["ptr"]))
        else:
            continue
        running += int(e["bytes"])
        peak = max(peak, running)
    assert peak > 128 * 256 * 4  # the hidden activation at least
    assert cap.peak("cpu") == peak
    steps = cap.steps("cpu")
    assert [s.step for s in steps if s.complete] == [1, 2, 3]
    assert max(s.peak for s in steps) == peak
    scopes = set(cap.events["scope"])
    assert any(s.startswith("## Call CompiledFxGraph") for s in scopes), "compiled-graph scopes missing"
    stack = cap.scope_stack_at_peak("cpu")
    assert stack, "no scope open at the peak"


def test_explicit_steps_replace_optimizer_steps() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    with memprof.capture() as cap:
        (p * 2).sum().backward()
        opt.step()  # marker 1 (optimizer)
        assert memprof.step() == 2  # explicit from now on
        opt.step()  # no marker
        assert memprof.step() == 3
    markers = cap.raw[cap.raw["kind"] == Kind.STEP]
    assert markers["bytes"].tolist() == [1, 2, 3]
    assert memprof.step() == 0  # no capture active


def test_frees_by_the_cyclic_garbage_collector_are_told_apart() -> None:
    """A tensor in a reference cycle is freed when a collection runs, not at its last reference:
    the capture marks every collection, and the frees inside one on its thread are the collector's,
    to the byte, per step; the summary, the text report and the sweep's measurement say so."""
    import gc

    from memprof.analysis.summary import summarize
    from memprof.sweep.measure import measure

    gc.collect()
    with memprof.capture() as cap:
        for _ in range(3):
            held = {"t": torch.empty(1000, dtype=torch.float32)}
            held["self"] = held  # a cycle: only the collector frees it
            plain = torch.empty(500, dtype=torch.float32)  # freed at its last reference
            del held, plain
            gc.collect()
            memprof.step()
    tl = cap.timeline("cpu")
    assert tl.delta[cap.gc_freed("cpu")].tolist() == [-4000, -4000, -4000]
    assert int((tl.delta < 0).sum()) == 6  # the three 2000-byte frees are not the collector's
    dev = summarize(cap).to_json()["devices"][0]
    assert dev["gc_freed"] == {"count": 3, "bytes": 12000,
                               "by_scope": [{"scope": "aten::empty", "bytes": 12000, "count": 3}]}
    assert [st["gc_freed_bytes"] for st in dev["steps"]] == [4000, 4000, 4000]
    text = render("text", cap)
    assert "cyclic garbage collector freed 3 allocations (12.0 kB, in 3 of 3 steps)" in text
    assert "12.0 kB  of them allocated in aten::empty (3 allocations)" in text
    assert measure(cap).gc_freed == 4000
    from memprof.analysis.garbage import garbage_at

    with memprof.capture() as held_cap:  # garbage live at the peak: the collector's bytes there, to the byte
        cycle = {"t": torch.empty(1000, dtype=torch.float32)}
        cycle["self"] = cycle
        del cycle
        top = torch.empty(3000, dtype=torch.float32)  # the peak: 4,000 B of garbage beside it
        del top
        gc.collect()
    tl = held_cap.timeline("cpu")
    assert tl.peak == 16000 and garbage_at(tl, tl.peak_pos, held_cap.gc_freed("cpu")) == 4000
    assert garbage_at(tl, tl.peak_pos, np.zeros(0, np.int64)) == 0
    with memprof.capture() as quiet:  # no cycle: nothing is the collector's
        t = torch.empty(100)
        del t
        gc.collect()
    assert len(quiet.gc_freed("cpu")) == 0 and "cyclic garbage" not in render("text", quiet)


def test_a_free_on_another_thread_during_a_collection_is_not_the_collectors() -> None:
    """A collection on one thread, and while it runs (its callback waits) another thread frees a tensor
    of its own: only the collecting thread's free inside its marks is the collector's."""
    import gc
    import threading

    go, done = threading.Event(), threading.Event()

    def pause(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and threading.current_thread().name == "collector" and not go.is_set():
            go.set()
            done.wait(10)  # (releases the GIL: the other thread frees now)

    def other() -> None:
        t = torch.empty(300, dtype=torch.float32)
        go.wait(10)
        del t  # inside the collector's marks, on this thread
        done.set()

    def collector() -> None:
        cycle = {"t": torch.empty(700, dtype=torch.float32)}
        cycle["self"] = cycle
        del cycle
        gc.collect()

    gc.collect()
    with memprof.capture() as cap:
        gc.callbacks.append(pause)
        try:
            threads = [threading.Thread(target=other), threading.Thread(target=collector, name="collector")]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            gc.callbacks.remove(pause)
    tl = cap.timeline("cpu")
    assert go.is_set() and done.is_set()
    assert tl.delta[cap.gc_freed("cpu")].tolist() == [-2800]  # the cycle's, not the other thread's 1,200 B
    assert sorted(tl.delta[tl.delta < 0].tolist()) == [-2800, -1200]


def test_a_traced_scripts_garbage_is_collected_when_it_ends(tmp_path: Path) -> None:
    """What only a reference cycle holds when a traced script ends (as Dynamo's compile of the graph
    after a break holds the first step's logits) is freed by a collection memprof runs then, as
    Python's exit would: the capture marks those frees as the collector's, so `garbage_at` (and
    `fit`'s certificate) can say the memory was garbage, where before it was never freed."""
    from memprof.analysis.garbage import garbage_at

    script = tmp_path / "cycle.py"
    script.write_text("import gc, torch\ngc.disable()\n"
                      "held = {'t': torch.empty(1000)}\nheld['self'] = held\ndel held\n"
                      "peak = torch.empty(3000)\ndel peak\n")
    res = run_memprof("trace", "-o", "c.memprof", str(script), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    cap = memprof.load(tmp_path / "c.memprof")
    tl = cap.timeline("cpu")
    assert tl.delta[cap.gc_freed("cpu")].tolist() == [-4000]
    assert tl.peak == 16000 and garbage_at(tl, tl.peak_pos, cap.gc_freed("cpu")) == 4000


def test_max_events_bounds_memory_and_counts_drops() -> None:
    with memprof.capture(max_events=10) as cap:
        for _ in range(20):
            torch.empty(8)
    assert len(cap.raw) == 10
    assert cap.dropped > 0
    text = render("text", cap)
    assert "dropped" in text.splitlines()[1] and "lower bound" in text.splitlines()[1]


def test_second_capture_is_refused() -> None:
    with memprof.capture(), pytest.raises(memprof.MemprofError, match="already active"), memprof.capture():
        pass


def test_refuses_to_start_under_torch_profiler() -> None:
    with torch.profiler.profile(), pytest.raises(memprof.MemprofError, match=r"torch\.profiler"), memprof.capture():
        pass


def test_profiler_started_during_capture_stops_it_cleanly() -> None:
    with memprof.capture() as cap:
        before = torch.empty(256)
        with torch.profiler.profile(profile_memory=True) as prof:
            torch.empty(512)
        del before
    assert not cap.recording
    assert cap.meta.get("stopped_by") == "torch.profiler"
    assert cap.peak("cpu") == 1024  # only the allocation before the profiler started
    assert not cap.exact and "torch.profiler" in cap.caveats[0]
    lines = render("text", cap).splitlines()
    assert "INCOMPLETE" in lines[1] and "torch.profiler" in lines[1]  # next to the figure, not at the bottom
    names = {e.name for e in prof.events()}
    assert "aten::empty" in names  # the profiler itself worked
    assert not memprof.active()


def test_events_view_columns() -> None:
    with memprof.capture() as cap:
        t = torch.zeros(3, dtype=torch.int64)
        del t
    ev = cap.events
    for name in ("t_ns", "kind", "bytes", "device", "scope", "seq"):
        assert name in ev.dtype.names
    assert ev["t_ns"].dtype == np.int64 and ev["bytes"].dtype == np.int64
    assert (np.diff(ev["t_ns"]) >= 0).all()
    mem = ev[ev["kind"] == "alloc"]
    assert mem["device"].tolist() == ["cpu"] and mem["bytes"].tolist() == [24]


def test_capture_data_before_stop_is_an_error() -> None:
    with memprof.capture() as cap, pytest.raises(memprof.MemprofError, match="still running"):
        _ = cap.events


def test_quiet_ops_record_no_scope_but_the_ones_memprof_opens() -> None:
    """`set_quiet` switches memprof's op scopes off on this thread alone (a compiled-graph call's
    body): the allocations are still recorded, inside the scopes memprof opens itself
    (`quiet_scope`), and scopes come back when it is switched on; out of a quiet stretch, or after
    the capture that went quiet stopped, `quiet_scope` records nothing."""
    from memprof._native import native

    C = native()
    w = torch.ones(8, 8)
    with memprof.capture() as cap:
        torch.mm(w, w)
        assert C.set_quiet(True) is False
        torch.mm(w, w)
        assert C.quiet_scope("aten::mine", True) is True
        torch.mm(w, w)
        assert C.quiet_scope("aten::mine", False) is True
        assert C.set_quiet(True) is True and C.set_quiet(False) is True
        torch.mm(w, w)
        assert C.quiet_scope("aten::mine", True) is False
        C.set_quiet(True)  # left quiet: the next capture starts loud all the same
    with memprof.capture() as second:
        assert C.quiet_scope("aten::mine", True) is False
        torch.mm(w, w)
    C.set_quiet(False)
    def begun(c: memprof.Capture) -> list[str]:
        return [c.scope_name(int(s)) for s in c.raw[c.raw["kind"] == Kind.SCOPE_BEGIN]["scope"]]

    one_mm = begun(second)  # a loud matmul's scopes (aten::mm and what it runs)
    assert one_mm[0] == "aten::mm"
    assert begun(cap) == [*one_mm, "aten::mine", *one_mm]
    allocs = cap.raw[cap.raw["kind"] == Kind.ALLOC]
    assert len(allocs) == 4 and [cap.scope_name(int(s)) for s in allocs["scope"]][1:3] == ["", "aten::mine"]


def test_an_ops_scope_is_recorded_where_an_event_happens_in_it() -> None:
    """An op's scope waits for an event inside it: an op that allocates and frees nothing leaves no
    scope (its two events were most of what op scopes cost a host-bound step); one that allocates has
    its begin, and its callers' outermost first, just before its first event; a user scope is
    recorded whether or not anything happens in it."""
    import gc

    x, y = torch.ones(4), torch.ones(4)
    gc.disable()  # (a collection in the block would free earlier tests' garbage there)
    try:
        with memprof.capture() as cap:
            x.mul_(y)  # in place: nothing allocated
            with torch.profiler.record_function("mine"):
                x.mul_(y)
            x.to(torch.float64)  # aten::to > aten::_to_copy > aten::empty_strided (allocates), aten::copy_ (not)
    finally:
        gc.enable()
    raw = cap.raw
    seen = [(Kind(int(k)).name, cap.scope_name(int(s))) for k, s in zip(raw["kind"], raw["scope"], strict=True)]
    assert seen == [("SCOPE_BEGIN", "mine"), ("SCOPE_END", "mine"),
                    ("SCOPE_BEGIN", "aten::to"), ("SCOPE_BEGIN", "aten::_to_copy"),
                    ("SCOPE_BEGIN", "aten::empty_strided"), ("ALLOC", "aten::empty_strided"),
                    ("SCOPE_END", "aten::empty_strided"), ("SCOPE_END", "aten::_to_copy"), ("SCOPE_END", "aten::to"),
                    ("FREE", "")]
    assert (np.diff(raw["t_ns"]) >= 0).all()  # (a begin written late takes its first event's time)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_every_steps_gradients_are_named_by_their_blocks(set_to_none: bool) -> None:
    """Gradients are read at every optimizer step (in C++: `memprof._C.GradWatch`), past the steps
    where the optimizer is walked whole: each step's new gradient tensors are named once, at their
    exact storage, and gradients kept from step to step (zero_grad(set_to_none=False)) once in all."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = ["0.weight", "0.bias", "2.weight"]
    seen: list[dict[str, tuple[int, int]]] = []
    with memprof.capture(scopes="none") as cap:
        for _ in range(20):  # (the optimizer is walked whole at steps 1 and 17)
            model(torch.randn(4, 8)).sum().backward()
            seen.append({n: (p.grad.untyped_storage().data_ptr(), p.grad.untyped_storage().nbytes())
                         for n, p in zip(names, model.parameters(), strict=True)})
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    grads = [t for t in cap.tensors if t.category == "gradient"]
    assert all(t.device == "cpu" for t in grads)
    if set_to_none:
        assert len(grads) == 20 * len(names)
        steps = [{t.name.removesuffix(".grad"): (t.ptr, t.bytes) for t in grads[i:i + 3]} for i in range(0, 60, 3)]
        assert steps == seen
    else:
        assert {t.name.removesuffix(".grad"): (t.ptr, t.bytes) for t in grads} == seen[0] == seen[-1]
        assert len(grads) == len(names)
    labels, allocs = cap.labels("cpu"), cap.timeline("cpu").is_alloc  # (a label per allocation and per free)
    named = Counter(labels.names[int(n)] for n, c, a in zip(labels.node, labels.category, allocs, strict=True)
                    if c == Category.GRADIENT and a)
    assert named == {f"gradient:{n}.grad": 20 if set_to_none else 1 for n in names}  # each step's blocks
