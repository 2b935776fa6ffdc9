"""Reading FX nodes without changing them: op names, random ops, sizes (never guarded), views,
mutations, module paths and fallback-kernel calls. Public helpers for the plan recorder and
the remat pass's FX adapter."""

from __future__ import annotations

import json
import re
from typing import Any

from memprof.analysis.wrapper_code import EXTERN_MATMULS
from memprof.plans import module_path

# Ops that draw from a generator. Inductor's own random numbers are drawn once per graph call, as a
# tensor of seeds (`inductor_seeds`); `inductor_lookup_seed` and `inductor_random` are pure functions
# of a seed and an element's index (philox, fused into the consuming kernel), so a backward that
# recomputes them from the forward's seeds makes the forward's very numbers: only the seeds are
# random here, and saving them (a few bytes) replays every dropout mask of the graph.
RANDOM_OPS = re.compile(
    r"^(rand|randn|randint|rand_like|randn_like|randint_like|randperm|bernoulli_?|normal_?|uniform_?|"
    r"exponential_?|geometric_?|cauchy_?|log_normal_?|multinomial|poisson|native_dropout|dropout|"
    r"feature_dropout|alpha_dropout|inductor_seeds?|philox_rand|run_and_save_rng_state)$"
)
SEEDED_OPS = frozenset({"inductor_random", "inductor_randint", "inductor_lookup_seed"})


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
    if name in ("run_with_rng_state", "graphsafe_run_with_rng_state"):  # replays saved RNG state
        return False
    if RANDOM_OPS.match(name):
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


def is_random_valued(node: Any) -> bool:
    """Whether an FX node's value is random numbers: drawn (`is_random_node`) or made from a drawn
    seed (Inductor's `inductor_random`, recomputable without a redraw)."""
    return is_random_node(node) or (node.op == "call_function" and op_name(node.target) in SEEDED_OPS)


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


def tensor_bytes(val: Any) -> int:
    """Bytes of the tensors in a node's value; a symbolic size counts at its hint (the traced
    example's value, read without adding a guard), a size without a hint counts nothing."""
    import torch

    vals = val if isinstance(val, (list, tuple)) else [val]
    total = 0
    for v in vals:
        if isinstance(v, torch.Tensor):
            try:
                total += size_hint(v.numel() * v.element_size()) or 0
            except Exception:
                continue
    return total


def numel(val: Any) -> int:
    """Elements of a tensor value at its size hint (0 for anything else)."""
    import torch

    if isinstance(val, torch.Tensor):
        try:
            return size_hint(val.numel()) or 0
        except Exception:
            return 0
    return 0


def item_sizes(val: Any) -> list[int]:
    """Bytes of each item of a tuple value (0 for a non-tensor or a symbolic size); [] for a single
    value. A fallback op that returns several tensors (an attention backward's three gradients)
    hands each to its own user, and each is freed on its own."""
    import torch

    if not isinstance(val, (list, tuple)):
        return []
    out: list[int] = []
    for v in val:
        nbytes = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
        out.append(nbytes if type(nbytes) is int else 0)
    return out


def value_info(val: Any) -> tuple[list[int] | None, str | None, int | None, str]:
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


def node_module_path(node: Any) -> str:
    """The module path of the innermost nn.Module a node was traced in ("" if unknown)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return module_path(str(last[0] if isinstance(last, tuple) else last))


def is_view(target: Any) -> bool:
    """Whether an op returns a view of its input (its schema's first return aliases, read-only)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def mutates(target: Any) -> bool:
    """Whether an op writes any argument (an op without a schema counts as mutating)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    return bool(getattr(schema, "is_mutable", False)) or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


class _NoSpec(Exception):
    pass


def _encode_arg(a: Any) -> Any:
    import torch

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
        return {"l": [_encode_arg(x) for x in a]}
    if a is None or type(a) in (bool, int, float, str):
        return a
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    raise _NoSpec


def probed(node: Any, fallbacks: Any) -> bool:
    """Whether a call node's scratch memory is measured (`memprof.sweep.probe`): the ops Inductor runs
    as fallback kernels, and the CPU's half-precision matrix multiplies, which Inductor calls as extern
    kernels writing into a buffer it made but which allocate a float accumulator of their own while
    they run (the output's elements in fp32, measured on torch 2.13's CPU: invisible in the wrapper
    code). The CPU's fp32 ones and every CUDA one allocate nothing beyond cuBLAS's kept workspace."""
    import torch

    if node.op != "call_function":
        return False
    if node.target in fallbacks:
        return True
    name = getattr(node.target, "__name__", "")
    val = node.meta.get("val")
    return (name.split(".")[0] in EXTERN_MATMULS and str(getattr(node.target, "namespace", "")) == "aten"
            and isinstance(val, torch.Tensor) and val.device.type == "cpu"
            and val.dtype in (torch.bfloat16, torch.float16))


def call_spec(node: Any) -> str:
    """A fallback kernel's call as JSON (op, tensor arguments as [shape, stride, dtype, device,
    storage offset], constants), or "" when an argument is symbolic or not plain data."""
    target = node.target
    try:
        op = f"{target.name()}.{target._overloadname}"
        return json.dumps({"op": op, "args": [_encode_arg(a) for a in node.args],
                           "kwargs": {k: _encode_arg(v) for k, v in node.kwargs.items()}})
    except (_NoSpec, AttributeError, TypeError, ValueError):
        return ""


def _shape_of(v: Any) -> Any:
    """A node argument as torch's flop formulas take it: tensors as tuples of hinted sizes (a
    symbolic size read without a guard; ValueError when one has no hint), other values as they are."""
    import torch

    if isinstance(v, torch.fx.Node):
        v = v.meta.get("val")
    if isinstance(v, torch.Tensor):
        dims = tuple(size_hint(d) for d in v.shape)
        if any(d is None for d in dims):
            raise ValueError("a size without a hint")
        return dims
    if isinstance(v, torch.SymInt):
        hint = size_hint(v)
        if hint is None:
            raise ValueError("a size without a hint")
        return hint
    if isinstance(v, (list, tuple)):
        return type(v)(_shape_of(x) for x in v)
    return v


def _attention_flops(name: str, args: list[Any]) -> float | None:
    """A `_scaled_dot_product_*` call's FLOPs from its query and key shapes (b, h, s, d): QK^T and
    PV, two matmuls of 2·b·h·s_q·s_k·d each; a backward is 2.5 times that, as torch counts it."""
    backward = "backward" in name
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    if not (isinstance(q, tuple) and isinstance(k, tuple) and len(q) == 4 and len(k) == 4):
        return None
    b, h, s_q, d = q
    flops = 4.0 * b * h * s_q * k[2] * d
    return float(2.5 * flops if backward else flops)


def op_flops(node: Any) -> float | None:
    """FLOPs of one FX call by torch's own formulas (`torch.utils.flop_counter`, what the stock
    partitioner's runtime estimate counts with), at the traced sizes. An attention call whose
    formula is missing (the CPU's fused kernel) or refuses its shapes (grouped-query heads, in some
    torch versions) is counted from its query and key shapes. None where no formula applies."""
    from torch.utils import flop_counter as _flop_counter

    flop_counter: Any = _flop_counter  # (its formulas are untyped)
    target = node.target
    formula = flop_counter.flop_registry.get(getattr(target, "overloadpacket", target))
    name = op_name(target)
    sdpa = name.startswith("_scaled_dot_product")  # (batch, heads, sequence, dim) layouts only
    if formula is None and not sdpa:  # most nodes: no shapes to read
        return None
    try:
        args = [_shape_of(a) for a in node.args]
    except Exception:  # a size without a hint: no figure rather than a wrong one
        return None
    if formula is not None:
        try:
            kwargs = {k: _shape_of(v) for k, v in node.kwargs.items()}
            return float(formula(*args, out_val=_shape_of(node.meta.get("val")), **kwargs))
        except Exception:
            pass
    return _attention_flops(name, args) if sdpa else None
