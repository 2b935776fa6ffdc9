"""Inductor's code generation, observed: for every graph `_compile_fx_inner` compiles, the FX
nodes behind each buffer (from the scheduler, at `GraphLowering.codegen`) and Inductor's own peak
estimates (`estimate_peak_memory`, as torch computes it and with graph outputs kept live), handed
to a sink with the compiled result. Also the partitioner's knapsack calls, for KnapsackEvaluator."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from memprof.errors import one_line
from memprof.torch_hooks.patch import Patches, patched


class GraphSink(Protocol):
    active: bool

    def graph_compiled(self, result: Any, kwargs: dict[str, Any], origins: list[dict[str, list[str]]],
                       estimates: list[tuple[int, int | None]]) -> None:
        """A graph compiled: its buffers' FX nodes per code generation, and Inductor's estimates
        (as torch computes them, and with outputs kept live; None where that failed)."""

    def error(self, text: str) -> None:
        """Something was not recorded (said once per text)."""


def buffer_origins(graph: Any) -> dict[str, list[str]]:
    """Buffer name -> the FX nodes it computes (in graph order), from Inductor's scheduler."""
    order = {n.name: i for i, n in enumerate(graph.orig_gm.graph.nodes)}
    out: dict[str, list[str]] = {}
    for snode in graph.scheduler.nodes:
        for sub in snode.get_nodes():
            node = getattr(sub, "node", None)
            origins = getattr(node, "origins", None) or ()
            names = sorted({o.name for o in origins}, key=lambda s: (order.get(s, 1 << 30), s))
            for buf in sub.get_outputs():
                out[buf.get_name()] = names
    return out


def peak_outputs_kept(memory: Any, nodes: Any, name_to_freeable_input_buf: Any, graph_outputs: Any,
                      *args: Any, **kwargs: Any) -> int:
    """Inductor's buffer timeline for a scheduled graph, peaked with graph outputs live to the end
    (torch 2.11's `estimate_peak_memory` frees them at step 0; 2.13 keeps them)."""
    infos, _steps, _last = memory.compute_memory_timeline(nodes, name_to_freeable_input_buf, graph_outputs)
    delta = [0] * (len(nodes) + 2)
    for b in infos:
        delta[b.start_step] += b.size_alloc
        if b.end_step != -1:
            delta[b.end_step + 1] -= b.size_free
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def cache_root() -> Path:
    """Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def install_graph_hooks(patches: Patches, sink: GraphSink) -> None:
    """Observe every graph Inductor compiles until `patches` is undone."""
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.memory as inductor_memory
    from torch._inductor.graph import GraphLowering

    local = threading.local()  # per compiling thread: a stack of (origins, estimates) per compile
    original_codegen = GraphLowering.codegen
    original_estimate = inductor_memory.estimate_peak_memory
    original_inner = compile_fx._compile_fx_inner

    def codegen(graph: Any) -> Any:
        result = original_codegen(graph)
        stack = getattr(local, "stack", None)
        if sink.active and stack:
            try:
                stack[-1][0].append(buffer_origins(graph))
            except Exception as exc:
                sink.error(f"buffer origins not recorded ({one_line(exc)})")
        return result

    def estimate_peak_memory(*args: Any, **kwargs: Any) -> Any:
        # called for each order reorder_for_peak_memory tries; recorded as torch computes it (2.11
        # cancels graph outputs: docs/sweep.md) and recomputed with outputs live to the end
        result = original_estimate(*args, **kwargs)
        stack = getattr(local, "stack", None)
        if stack:
            kept: int | None = None
            with contextlib.suppress(Exception):
                kept = peak_outputs_kept(inductor_memory, *args, **kwargs)
            with contextlib.suppress(Exception):
                stack[-1][1].append((int(result[0]), kept))
        return result

    def compile_inner(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        stack = local.__dict__.setdefault("stack", [])
        stack.append(([], []))
        try:
            result = original_inner(gm, example_inputs, *args, **kwargs)
        finally:
            origins, estimates = stack.pop()
        if sink.active:
            try:
                sink.graph_compiled(result, kwargs, origins, estimates)
            except Exception as exc:
                sink.error(f"compiled graph not recorded ({one_line(exc)})")
        return result

    compile_inner.__wrapped__ = original_inner  # type: ignore[attr-defined]
    patches.set("torch._inductor.graph", "GraphLowering.codegen", codegen)
    patches.set("torch._inductor.memory", "estimate_peak_memory", estimate_peak_memory)
    patches.set("torch._inductor.compile_fx", "_compile_fx_inner", compile_inner)


def install_reuse_rule(patches: Patches) -> None:
    """In a backward graph memprof's remat pass planned, Inductor's wrapper hands a freed buffer on
    only to the next kernel's allocation, never over a distance, until `patches` is undone.

    Inductor reuses a freed buffer for a later allocation of its size when its own estimate of the
    bytes live in between, plus the buffer, stays under its estimate of the graph's peak. Torch
    2.11 puts a backward's peak at its start (it lets the gradients go at once), so the buffers
    handed over a distance fill the end of the backward, where the gradients really peak, up to
    that figure: on the GQA decoder, six 23 MB buffers held from the last layer to the first
    (docs/remat.md, Limits). Freed and allocated again instead, a buffer is never held in between,
    so the allocated bytes can only be fewer; the pass's own estimate of the backward counts
    buffers that way."""
    from torch._inductor.codegen.wrapper import AllocateLine
    from torch._inductor.virtualized import V

    original = AllocateLine.should_reuse_buffer

    def should_reuse_buffer(self: Any, free_line: Any, size: int) -> bool:
        if not original(self, free_line, size):
            return False
        if getattr(self, "comm_buffer", False) or free_line.scheduler_node_index + 1 == self.scheduler_node_index:
            return True
        module = getattr(V.graph, "orig_gm", None)
        return "memprof_remat" not in getattr(module, "meta", {})

    patches.set("torch._inductor.codegen.wrapper", "AllocateLine.should_reuse_buffer", should_reuse_buffer)


KnapsackCall = tuple[float, Any, list[float], list[float], list[Any], list[int], list[int]]


def install_knapsack_hook(patches: Patches, on_call: Callable[[KnapsackCall], None]) -> None:
    """Every knapsack the partitioner solves: (max memory, joint graph, memories, runtimes,
    candidates, saved indices, recomputed indices), to `on_call`."""
    import torch._functorch.partitioners as P

    original = P._optimize_runtime_with_given_memory

    def optimize(joint_graph: Any, memory: Any, runtimes: Any, max_memory: float, node_info: Any,
                 candidates: Any) -> Any:
        result = original(joint_graph, memory, runtimes, max_memory, node_info, candidates)
        on_call((float(max_memory), joint_graph, list(memory), list(runtimes), list(candidates),
                 list(result[1]), list(result[2])))
        return result

    patches.set("torch._functorch.partitioners", "_optimize_runtime_with_given_memory", optimize)


def knapsack_evaluator_peak(call: KnapsackCall) -> float:
    """The partitioner's in-tree `KnapsackEvaluator` peak for the knapsack's own choice (its
    backward simulation; in the knapsack's normalized memory units, so only its ranking compares)."""
    from torch._functorch._activation_checkpointing.graph_info_provider import GraphInfoProvider
    from torch._functorch._activation_checkpointing.knapsack_evaluator import KnapsackEvaluator

    _budget, joint_graph, memory, runtimes, candidates, saved, recomputed = call
    provider = GraphInfoProvider.inialize_from_graph(
        joint_graph=joint_graph, all_recomputable_banned_nodes=candidates,
        recorded_knapsack_input_memories=memory, recorded_knapsack_input_runtimes=runtimes)
    out = KnapsackEvaluator(graph_info_provider=provider).evaluate_knapsack_output(
        saved_nodes_idxs=saved, recomputable_node_idxs=recomputed, account_for_backward_pass=True)
    return float(out["peak_memory"])


# a Triton kernel defined in an Inductor wrapper module, and its autotuning heuristic's decorator call
_TRITON_DEF = re.compile(r"^(\w+) = async_compile\.triton\('\w+', (r?'''.*?''')", re.S | re.M)
_HEURISTIC = re.compile(r"^@(triton_heuristics\.\w+\(.*?)\n@triton\.jit", re.S | re.M)


class _Tunes(Exception):  # (whether a kernel benchmarks at its first launch: raised from inside Inductor's decorator)
    def __init__(self, tunes: bool) -> None:
        super().__init__(tunes)
        self.tunes = tunes


def kernel_heuristics(source: str) -> dict[str, tuple[str, str | None]]:
    """The Triton kernels an Inductor wrapper module defines: name -> (the kernel's source, as
    Inductor loads it, and its heuristic decorator's call, `triton_heuristics.NAME(...)`; None where
    it has none)."""
    import ast

    out: dict[str, tuple[str, str | None]] = {}
    for m in _TRITON_DEF.finditer(source):
        try:
            kernel_source = ast.literal_eval(m.group(2))
        except (ValueError, SyntaxError):  # (not a plain string literal: read as no decorator)
            out[m.group(1)] = (m.group(2), None)
            continue
        call = _HEURISTIC.search(kernel_source)
        out[m.group(1)] = (kernel_source, call.group(1) if call else None)
    return out


def autotuned_kernels(source: str) -> tuple[frozenset[str], int] | None:
    """The Triton kernels of an Inductor wrapper module that benchmark their configs at their first
    launch (more than one config, or coordinate descent tuning on, and no best config in Inductor's
    autotune cache), and how many kernels could not be told (their decorator
    did not evaluate). Each benchmark allocates a buffer of the L2 cache's size
    (`l2_flush_bytes`) before its timings, inside the launch. Evaluates each kernel's heuristic
    decorator as Inductor does when it loads the kernel, stopped once the configs are known: no
    kernel is compiled. None without Triton (a CPU-only torch), where Inductor's kernels are C++.
    It evaluates the decorator's Python: give it code Inductor generated, never a capture file's
    text from elsewhere."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return None
    from torch._inductor.codecache import get_hash, get_path
    from torch._inductor.runtime import hints, triton_heuristics

    check = triton_heuristics.check_autotune_cache

    def counted(configs: Any, filename: Any, inductor_meta: Any, *args: Any, **kwargs: Any) -> Any:
        kept, _cache, info = check(configs, filename, inductor_meta, *args, **kwargs)
        # several configs to time, or one that coordinate descent tunes; none once a best one is cached
        tunes = len(kept) > 1 or bool(inductor_meta.get("coordinate_descent_tuning"))
        raise _Tunes(tunes and not (isinstance(info, dict) and info.get("autotune_cache_state") == "hit"))

    names = {n: getattr(hints, n) for n in ("AutotuneHint", "ReductionHint", "TileHint", "DeviceProperties")}
    out: set[str] = set()
    failed = 0
    with patched("torch._inductor.runtime.triton_heuristics", "check_autotune_cache", counted):
        for name, (kernel_source, call) in kernel_heuristics(source).items():
            try:
                if call is None:
                    raise ValueError("no heuristic decorator")
                # the file Inductor loads the kernel from (its autotune cache sits beside it)
                path = get_path(get_hash(kernel_source.strip(), "", "code"), "py")[2]
                eval(call, {"triton_heuristics": triton_heuristics, "__file__": path, **names})
                failed += 1  # (the decorator returned without asking the cache: not a kernel it knows)
            except _Tunes as t:
                if t.tunes:
                    out.add(name)
            except Exception:
                failed += 1
    return frozenset(out), failed


def l2_flush_bytes(device: int) -> int:
    """The bytes Inductor's benchmarker allocates to flush the cache before timing a kernel: the
    device's L2 cache in int32s (`InductorBenchmarker.benchmark_gpu`), or Triton's `do_bench`
    256 MiB buffer where torch benchmarks with it (`TritonBenchmarker`)."""
    import torch
    from torch._inductor.runtime import benchmarking

    bench = benchmarking.benchmarker
    if not isinstance(bench, benchmarking.InductorBenchmarker) or torch.version.hip:
        return 256 * 1024 * 1024
    return int(torch.cuda.get_device_properties(device).L2_cache_size) // 4 * 4
