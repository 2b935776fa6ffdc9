"""Recording compile plans during a capture (the FX adapter; everything that touches torch.compile).

While a capture runs, `PlanRecorder`:
- wraps the partitioner: `torch._inductor.config.custom_partitioner_fn` under Inductor (its
  `uuid()` is None, so no cache can skip it), `partition_fn` of every other AOTAutograd backend
  (aot_eager, ...). It records both FX graphs, the saved values, the recomputed nodes, the
  random ops and the budget. It never changes the partition itself (inside `memprof.remat.enable`
  it runs that pass and records the result) and never fails the user's compile: any internal
  error is recorded as a note and the stock result is returned.
- captures each compiled graph's wrapper source and the FX nodes behind every buffer (from
  Inductor's scheduler), and gives each graph a unique key so that its runtime
  `## Call CompiledFxGraph <key> ##` scope can be joined to it.
- turns Inductor's FX graph and AOTAutograd caches off for the capture: a cache hit would skip
  the partitioner and code generation, and with them the plan.
- records which tensors are parameters, gradients and optimizer state (`PlanRecorder.tensors`).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

from memprof.errors import one_line
from memprof.plans import CompiledGraph, FxGraph, FxNode, Plan, RecomputedNode, module_path

_RANDOM_OPS = re.compile(
    r"^(rand|randn|randint|rand_like|randn_like|randint_like|randperm|bernoulli_?|normal_?|uniform_?|"
    r"exponential_?|geometric_?|cauchy_?|log_normal_?|multinomial|poisson|native_dropout|dropout|"
    r"feature_dropout|alpha_dropout|inductor_random|inductor_seeds|inductor_lookup_seed|philox_rand|"
    r"run_and_save_rng_state)$"
)
_counter = itertools.count()


def op_name(target: Any) -> str:
    """An op's short name (`mm`, `native_dropout`, `getitem`)."""
    name = getattr(target, "_opname", None)
    if isinstance(name, str):
        return name
    return getattr(target, "__name__", str(target))


def is_random_node(node: Any) -> bool:
    """Whether an FX node draws random numbers (so recomputing it redraws them)."""
    import torch

    if node.op != "call_function":
        return False
    name = op_name(node.target)
    if name == "run_with_rng_state":  # replays saved RNG state: deterministic
        return False
    if _RANDOM_OPS.match(name):
        return True
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        # SDPA kernels carry the tag even without dropout: random only when dropout_p > 0
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            names = [a.name for a in schema.arguments]
            if "dropout_p" in names:
                i = names.index("dropout_p")
                p = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else 0.0)
                return not (isinstance(p, (int, float)) and p == 0)
        return True
    return False


def size_hint(x: Any) -> int | None:
    """A size as an int without adding a guard: a plain int as is, a symbolic size's hint (its
    value in the example inputs the graph was traced with), None when it has none (unbacked).

    `int()` on a SymInt would specialize the graph on that value (a guard such as
    `Eq(128*s27, 1280)`), so a dynamic-shape graph would recompile for every size; memprof must
    never change what Dynamo compiles.
    """
    if type(x) is int:
        return x
    node: Any = getattr(x, "node", None)
    hint = getattr(node, "_hint", None)
    if type(hint) is int:
        return hint
    shape_env = getattr(node, "shape_env", None)
    if shape_env is None:
        return None
    try:  # ShapeEnv.size_hint adds no guard
        value = shape_env.size_hint(node.expr, allow_none=True)
    except Exception:
        return None
    try:
        return None if value is None else int(value)  # a sympy Integer
    except (TypeError, ValueError):
        return None


def _value_info(val: Any) -> tuple[list[int] | None, str | None, int | None, str]:
    """Shape, dtype and bytes of a node's value (bytes summed over tuple outputs), and its byte
    count as a symbolic expression ("" when static). Symbolic sizes give shape and bytes None and
    never add a guard (`size_hint`)."""
    import torch

    vals = val if isinstance(val, (list, tuple)) else [val]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if not tensors:
        return None, None, None, ""
    static = 0  # bytes of the tensors of static size
    known = True  # every size known (no symbolic or unreadable one)
    exprs: list[str] = []
    for t in tensors:
        try:
            nbytes = t.numel() * t.element_size()
        except Exception:
            known = False
            continue
        if type(nbytes) is int:
            static += nbytes
        else:  # str() of a SymInt reads its expression without guarding on it
            known = False
            exprs.append(str(nbytes))
    first = tensors[0]
    dims = list(first.shape)
    shape: list[int] | None = [int(d) for d in dims] if all(type(d) is int for d in dims) else None
    expr = " + ".join(exprs + ([str(static)] if static else [])) if exprs else ""
    return shape, str(first.dtype).replace("torch.", ""), static if known else None, expr


class _NoSpec(Exception):
    pass


def call_spec(node: Any) -> str:
    """A fallback kernel's call as JSON (op, tensor arguments as [shape, stride, dtype, device,
    storage offset], constants), or "" when an argument is symbolic or not plain data."""
    import json

    import torch

    def enc(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                raise _NoSpec
            dims = [*v.shape, *v.stride(), v.storage_offset()]
            if not all(type(x) is int for x in dims):  # symbolic: never specialize it here
                raise _NoSpec
            return {"t": [list(v.shape), list(v.stride()), str(v.dtype).removeprefix("torch."), str(v.device),
                          v.storage_offset()]}
        if isinstance(a, (list, tuple)):
            return {"l": [enc(x) for x in a]}
        if a is None or type(a) in (bool, int, float, str):
            return a
        if isinstance(a, torch.dtype):
            return {"dtype": str(a).removeprefix("torch.")}
        if isinstance(a, torch.device):
            return {"device": str(a)}
        raise _NoSpec

    target = node.target
    try:
        op = f"{target.name()}.{target._overloadname}"
        return json.dumps({"op": op, "args": [enc(a) for a in node.args],
                           "kwargs": {k: enc(v) for k, v in node.kwargs.items()}})
    except (_NoSpec, AttributeError, TypeError, ValueError):
        return ""


def fx_graph(gm: Any) -> FxGraph:
    """Plain-data copy of a GraphModule's nodes (taken before Inductor's passes mutate it)."""
    import sys

    random = {n.name for n in gm.graph.nodes if is_random_node(n)}
    # ops Inductor will run as fallback kernels (their scratch memory is invisible in its wrapper)
    lowering = sys.modules.get("torch._inductor.lowering")
    fallbacks = getattr(lowering, "fallbacks", ())
    nodes: list[FxNode] = []
    for n in gm.graph.nodes:
        shape, dtype, nbytes, size_expr = _value_info(n.meta.get("val"))
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
        path = ""
        if stack:
            last = list(stack.values())[-1]
            path = module_path(str(last[0] if isinstance(last, tuple) else last))
        sources = n.meta.get("from_node") or []
        source = str(getattr(sources[0], "name", "")) if sources else ""
        mask = False
        if dtype == "bool" and n.op == "call_function":
            frontier, seen = list(n.all_input_nodes), 0
            for _ in range(3):  # a mask is a comparison of (a view of) random values
                if any(f.name in random for f in frontier):
                    mask = True
                    break
                frontier = [i for f in frontier for i in f.all_input_nodes]
                seen += len(frontier)
                if seen > 64:
                    break
        nodes.append(FxNode(
            name=n.name, op=n.op, target=str(n.target) if n.op != "placeholder" else "",
            shape=shape, dtype=dtype, bytes=nbytes, size_expr=size_expr, users=[u.name for u in n.users],
            module_path=path, source=source, random=n.name in random, mask=mask,
            call=call_spec(n) if n.op == "call_function" and n.target in fallbacks else "",
        ))
    return FxGraph(nodes)


def _peak_outputs_kept(memory: Any, nodes: Any, name_to_freeable_input_buf: Any, graph_outputs: Any,
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


def _knapsack_evaluator_peak(joint_graph: Any, memory: list[float], runtimes: list[float], candidates: list[Any],
                             saved: list[int], recomputed: list[int]) -> float:
    """The partitioner's in-tree `KnapsackEvaluator` peak for the knapsack's own choice (its
    backward simulation; in the knapsack's normalized memory units, so only its ranking compares)."""
    from torch._functorch._activation_checkpointing.graph_info_provider import GraphInfoProvider
    from torch._functorch._activation_checkpointing.knapsack_evaluator import KnapsackEvaluator

    provider = GraphInfoProvider.inialize_from_graph(
        joint_graph=joint_graph, all_recomputable_banned_nodes=candidates,
        recorded_knapsack_input_memories=memory, recorded_knapsack_input_runtimes=runtimes)
    out = KnapsackEvaluator(graph_info_provider=provider).evaluate_knapsack_output(
        saved_nodes_idxs=saved, recomputable_node_idxs=recomputed, account_for_backward_pass=True)
    return float(out["peak_memory"])


def build_plan(index: int, backend: str, partitioner: str, budget: float, num_fwd_outputs: int,
               fw: Any, bw: Any, remat: dict[str, Any] | None = None, knapsack_peak: float | None = None) -> Plan:
    """Describe a partition: saved values, recomputed nodes and where the backward uses them."""
    fwg, bwg = fx_graph(fw), fx_graph(bw)
    out = next(n for n in fw.graph.nodes if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    saved = [str(getattr(a, "name", a)) for a in outs[num_fwd_outputs:]]
    fw_calls = {n.name for n in fwg.nodes if n.op == "call_function"}
    bw_index = bwg.index
    recomputed: list[RecomputedNode] = []
    for i, n in enumerate(bwg.nodes):
        if n.op == "call_function" and n.name in fw_calls:
            uses = [bw_index[u] for u in n.users if u in bw_index]
            recomputed.append(RecomputedNode(n.name, i, min(uses, default=i), max(uses, default=i),
                                             fwg.by_name[n.name].bytes))
    random_ops = [n.name for n in fwg.nodes if n.random]
    rec_names = {r.name for r in recomputed}
    names = [r.name for r in recomputed]
    masks = [n.name for n in fwg.nodes if n.mask and (n.name in saved or n.name in rec_names)]
    return Plan(
        index=index, backend=backend, partitioner=partitioner, budget=budget, num_fwd_outputs=num_fwd_outputs,
        forward=fwg, backward=bwg, saved=saved, recomputed=names, recompute_sites=recomputed, random_ops=random_ops,
        recomputed_random=[n for n in random_ops if n in rec_names], masks=masks, remat=remat,
        knapsack_peak=knapsack_peak,
    )


def resolve_budget(joint: Any) -> float:
    """The budget the partitioner applies: the config value, unless a node carries its own."""
    import torch._functorch.config as functorch_config

    for n in joint.graph.nodes:
        b = n.meta.get("memory_budget")
        if isinstance(b, float):
            return b
    return float(functorch_config.activation_memory_budget)


class PlanRecorder:
    """Installs the compile hooks for one capture and collects what they see."""

    def __init__(self, now_ns: Callable[[], int], note: Callable[[str], None],
                 knapsack_evaluator: bool = False) -> None:
        self.now_ns = now_ns
        self.note = note
        self.knapsack_evaluator = knapsack_evaluator  # run KnapsackEvaluator on each knapsack plan
        self.plans: list[Plan] = []
        self.graphs: list[CompiledGraph] = []
        # known tensors: (t_ns, device, ptr, nbytes, category, name)
        self.tensors: list[tuple[int, str, int, int, str, str]] = []
        self.active = False
        self._graph_plan: dict[int, int] = {}
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []
        self._errors: set[str] = set()
        self._param_names: dict[int, str] = {}

    # -- install / uninstall ------------------------------------------------------------
    def install(self) -> None:
        self.active = True
        if self.knapsack_evaluator:
            try:
                self._install_knapsack()
            except Exception as exc:
                self._error(f"knapsack hook unavailable ({one_line(exc)}); no KnapsackEvaluator peaks")
        try:
            self._install_inductor()
        except Exception as exc:  # an unexpected torch version: capture without plans
            self._error(f"Inductor hooks unavailable ({one_line(exc)}); no compile plans")
        try:
            self._install_aot()
        except Exception as exc:
            self._error(f"AOTAutograd hook unavailable ({one_line(exc)})")

    def uninstall(self) -> None:
        self.active = False
        while self._undo:
            self._undo.pop()()

    def _error(self, text: str) -> None:
        if text not in self._errors:
            self._errors.add(text)
            self.note(text)

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        old = getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old))

    def _install_inductor(self) -> None:
        import torch._functorch.config as functorch_config
        import torch._inductor.compile_fx as compile_fx
        import torch._inductor.config as inductor_config
        from torch._inductor.custom_graph_pass import CustomPartitionerFn
        from torch._inductor.graph import GraphLowering

        recorder = self

        class MemprofPartitioner(CustomPartitionerFn):  # type: ignore[misc]
            """Records the plan of each partition; uuid() None keeps caches from skipping it."""

            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __call__(self, gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
                return recorder.partition(self.inner, gm, joint_inputs, "inductor", kwargs)

            def uuid(self) -> None:
                return None

        MemprofPartitioner._memprof_recorder = True  # type: ignore[attr-defined]
        self._patch(inductor_config, "custom_partitioner_fn", MemprofPartitioner(inductor_config.custom_partitioner_fn))
        self._patch(inductor_config, "force_disable_caches", True)
        self._patch(functorch_config, "enable_autograd_cache", False)

        original_codegen = GraphLowering.codegen

        def codegen(graph: Any) -> Any:
            result = original_codegen(graph)
            stack = getattr(recorder._local, "codegens", None)
            if recorder.active and stack:
                try:
                    stack[-1].append(recorder._origins(graph))
                except Exception as exc:
                    recorder._error(f"buffer origins not recorded ({one_line(exc)})")
            return result

        self._patch(GraphLowering, "codegen", codegen)

        import torch._inductor.memory as inductor_memory

        original_estimate = inductor_memory.estimate_peak_memory

        def estimate_peak_memory(*args: Any, **kwargs: Any) -> Any:
            # Inductor's own estimate of the graph being scheduled (reorder_for_peak_memory calls it
            # for each order it tries), recorded as torch computes it (2.11 cancels graph outputs,
            # shared/notes/torch-internals.md §4) and recomputed from the same buffer timeline with
            # outputs live to the end
            result = original_estimate(*args, **kwargs)
            stack = getattr(recorder._local, "estimates", None)
            if stack:
                kept: int | None = None
                with contextlib.suppress(Exception):
                    kept = _peak_outputs_kept(inductor_memory, *args, **kwargs)
                with contextlib.suppress(Exception):
                    stack[-1].append((int(result[0]), kept))
            return result

        self._patch(inductor_memory, "estimate_peak_memory", estimate_peak_memory)

        original_inner = compile_fx._compile_fx_inner

        def compile_inner(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
            stack = recorder._local.__dict__.setdefault("codegens", [])
            estimates = recorder._local.__dict__.setdefault("estimates", [])
            stack.append([])
            estimates.append([])
            try:
                result = original_inner(gm, example_inputs, *args, **kwargs)
            finally:
                codegens = stack.pop()
                found = estimates.pop()
            if recorder.active:
                try:
                    as_is = [a for a, _k in found]
                    kept = [k for _a, k in found if k is not None]
                    recorder.add_graph(result, kwargs, codegens, min(as_is) if as_is else None,
                                       min(kept) if kept else None)
                except Exception as exc:
                    recorder._error(f"compiled graph not recorded ({one_line(exc)})")
            return result

        compile_inner.__wrapped__ = original_inner  # type: ignore[attr-defined]
        self._patch(compile_fx, "_compile_fx_inner", compile_inner)

    def _install_knapsack(self) -> None:
        import torch._functorch.partitioners as P

        recorder = self
        original = P._optimize_runtime_with_given_memory

        def optimize(joint_graph: Any, memory: Any, runtimes: Any, max_memory: float, node_info: Any,
                     candidates: Any) -> Any:
            result = original(joint_graph, memory, runtimes, max_memory, node_info, candidates)
            calls = getattr(recorder._local, "knapsack", None)
            if calls is not None:  # kept for the plan; evaluated once the partition is done
                calls.append((float(max_memory), joint_graph, list(memory), list(runtimes), list(candidates),
                              list(result[1]), list(result[2])))
            return result

        self._patch(P, "_optimize_runtime_with_given_memory", optimize)

    def _install_aot(self) -> None:
        from torch._dynamo.backends.common import AotAutograd
        from torch._functorch.partitioners import default_partition

        recorder = self
        original_call = AotAutograd.__call__

        def call(backend: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            partition_fn = backend.kwargs.get("partition_fn", default_partition)
            module = getattr(getattr(partition_fn, "func", partition_fn), "__module__", "") or ""
            if not recorder.active or module.startswith("torch._inductor") or getattr(partition_fn, "_memprof", False):
                return original_call(backend, gm, example_inputs, **kwargs)
            name = getattr(backend.kwargs.get("fw_compiler"), "__name__", "aot")
            label = "aot_eager" if name in ("boxed_nop", "nop") else f"aot_autograd({name})"

            def wrapped(joint: Any, joint_inputs: Any, **kw: Any) -> Any:
                return recorder.partition(partition_fn, joint, joint_inputs, label, kw)

            wrapped._memprof = True  # type: ignore[attr-defined]
            clone = AotAutograd(**{**backend.kwargs, "partition_fn": wrapped})
            return original_call(clone, gm, example_inputs, **kwargs)

        self._patch(AotAutograd, "__call__", call)

    # -- recording ----------------------------------------------------------------------
    def partition(self, inner: Any, gm: Any, joint_inputs: Any, backend: str, kwargs: dict[str, Any]) -> Any:
        """Run the partitioner (the stock one unless the user set their own) and record its plan."""
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from memprof import remat
        from memprof.remat import fx as remat_fx

        fn = inner if inner is not None else min_cut_rematerialization_partition
        budget = None
        try:
            budget = resolve_budget(gm)
        except Exception as exc:
            self._error(f"budget not resolved ({one_line(exc)})")
        mode = remat.active_mode()
        self._local.knapsack = []
        try:
            if mode is not None and not getattr(fn, "_memprof_remat", False):
                fw, bw = remat_fx.partition(fn, gm, joint_inputs, mode, kwargs)
            else:
                fw, bw = fn(gm, joint_inputs, **kwargs)
        finally:
            calls, self._local.knapsack = self._local.knapsack, None
        if not self.active:
            return fw, bw
        knapsack_peak: float | None = None
        call = next((c for c in calls if budget is not None and abs(c[0] - budget) < 1e-9), None)
        if call is not None:
            try:
                knapsack_peak = _knapsack_evaluator_peak(*call[1:])
            except Exception as exc:
                self._error(f"KnapsackEvaluator failed ({one_line(exc)})")
        try:
            index = len(self.plans)
            report = getattr(bw, "meta", {}).get("memprof_remat")
            plan = build_plan(index, backend, getattr(fn, "__name__", type(fn).__name__),
                              budget if budget is not None else float("nan"),
                              int(kwargs.get("num_fwd_outputs", 0)), fw, bw,
                              report.to_json() if report is not None else None, knapsack_peak)
            self.plans.append(plan)
            self._local.last_plan = index
            self.record_modules()
        except Exception as exc:
            self._error(f"a compile plan was not recorded ({one_line(exc)})")
        return fw, bw

    def _origins(self, graph: Any) -> dict[str, list[str]]:
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

    def add_graph(self, result: Any, kwargs: dict[str, Any], codegens: list[dict[str, list[str]]],
                  inductor_estimate: int | None = None, inductor_estimate_kept: int | None = None) -> None:
        import torch._inductor.config as inductor_config

        source = getattr(result, "source_code", None)
        if not hasattr(result, "_fx_graph_cache_key") or not isinstance(source, str):
            self._error(f"a compiled graph of type {type(result).__name__} has no Python wrapper; "
                        "its allocations are attributed at kernel level")
            return
        key = result._fx_graph_cache_key
        if not key:
            key = f"memprof-{os.getpid()}-{next(_counter)}"
            result._fx_graph_cache_key = key  # only names the graph's profiler scope
        is_backward = bool(kwargs.get("is_backward"))
        role = "backward" if is_backward else ("inference" if kwargs.get("is_inference") else "forward")
        graph_id = kwargs.get("graph_id")
        plan: int | None = None
        if role == "forward":
            plan = getattr(self._local, "last_plan", None)
            self._local.last_plan = None
            if plan is not None and graph_id is not None:
                self._graph_plan[int(graph_id)] = plan
        elif role == "backward" and graph_id is not None:
            plan = self._graph_plan.get(int(graph_id))
        notes: list[str] = []
        if kwargs.get("cpp_wrapper"):
            notes.append("cpp_wrapper")
        cudagraphs = kwargs.get("cudagraphs")
        if cudagraphs is not None and bool(getattr(cudagraphs, "value", cudagraphs)):
            notes.append("CUDA graphs")
        if inductor_config.memory_planning:
            notes.append("memory planning")
        origins = codegens[-1] if codegens else {}
        self.graphs.append(CompiledGraph(key=str(key), role=role, plan=plan,
                                         graph_id=None if graph_id is None else int(graph_id),
                                         origins=origins, source=source, notes=notes,
                                         inductor_estimate=inductor_estimate,
                                         inductor_estimate_kept=inductor_estimate_kept))

    def _add_tensor(self, t_ns: int, tensor: Any, category: str, name: str) -> None:
        try:
            if tensor.device.type == "meta" or getattr(tensor, "is_fake", False):
                return
            from torch._subclasses.fake_tensor import is_fake

            if is_fake(tensor):
                return
            storage = tensor.untyped_storage()
            ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
        except Exception:
            return
        if ptr and nbytes:
            device = str(tensor.device) if tensor.device.type != "cuda" else f"cuda:{tensor.device.index or 0}"
            self.tensors.append((t_ns, device, ptr, nbytes, category, name))

    def record_modules(self) -> None:
        """Parameters and buffers of every live nn.Module (names from the outermost modules)."""
        import torch

        modules = []
        with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
            warnings.simplefilter("ignore")
            for o in gc.get_objects():
                try:
                    if isinstance(o, torch.nn.Module):
                        modules.append(o)
                except ReferenceError:  # a weakref.proxy whose object is gone
                    continue
        children = {id(c) for m in modules for c in m.children()}
        t = self.now_ns()
        seen: set[int] = set()
        for root in modules:
            if id(root) in children:
                continue
            for name, p in itertools.chain(root.named_parameters(), root.named_buffers()):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self._param_names[id(p)] = name.removeprefix("_orig_mod.")
                self._add_tensor(t, p, "parameter", name.removeprefix("_orig_mod."))

    def record_optimizer(self, optimizer: Any) -> None:
        """Parameters, gradients and optimizer state after an optimizer step."""
        t = self.now_ns()
        names = {id(p): self._param_names.get(id(p), f"param_groups[{gi}][{pi}]")
                 for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])}
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._add_tensor(t, p, "parameter", names[id(p)])
                if p.grad is not None:
                    self._add_tensor(t, p.grad, "gradient", names[id(p)] + ".grad")
                for key, value in optimizer.state.get(p, {}).items():
                    if hasattr(value, "untyped_storage"):
                        self._add_tensor(t, value, "optimizer_state", f"{names[id(p)]}.{key}")
