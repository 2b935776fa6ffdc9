"""Allocation sizes in Inductor's wrapper code: static ones from shape, stride and dtype, and
symbolic ones (dynamic shapes) as functions of the size symbols, solved per call."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from memprof.analysis.units import CUDA_BLOCK, CUDA_LARGE_SLACK, block_fits

# Bytes per element of the dtypes Inductor writes as `torch.<name>`.
DTYPE_BYTES = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16, "complex32": 4,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}

_SYMBOL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\b")


def static_bytes(shape: str, stride: str, dtype: str) -> int | None:
    try:
        sizes = [int(x) for x in shape.replace(" ", "").split(",") if x]
        strides = [int(x) for x in stride.replace(" ", "").split(",") if x]
    except ValueError:
        return None
    item = DTYPE_BYTES.get(dtype)
    if item is None or len(sizes) != len(strides):
        return None
    if any(s == 0 for s in sizes):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(sizes, strides, strict=True))) * item


def split_top(text: str) -> list[str]:
    """Split a comma-separated argument list at depth 0."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


# -- symbolic sizes (dynamic shapes) -------------------------------------------------------------
# A dynamic graph's wrapper writes sizes as expressions of its size symbols (`(2*s50, 32)`), whose
# values change from call to call and are not recorded. Per call, `check_symbolic_sizes` finds
# values of the symbols that make every symbolic allocation the size the allocator handed out, or
# says which allocation no value explains (the join then falls back to kernel level).

_SIZE_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_SIZE_CALLS = {"max": max, "min": min}


@dataclass(frozen=True)
class SizeFunction:
    """Bytes of an allocation as a function of its size symbols."""

    symbols: tuple[str, ...]
    fn: Callable[[Mapping[str, int]], int]

    def __call__(self, values: Mapping[str, int]) -> int:
        return self.fn(values)


def _size_expr(node: ast.AST) -> Callable[[Mapping[str, int]], int]:
    """A closure evaluating a whitelisted integer expression (no eval of file contents)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
        return lambda env: value
    if isinstance(node, ast.Name):
        name = node.id
        return lambda env: env[name]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _size_expr(node.operand)
        return lambda env: -inner(env)
    if isinstance(node, ast.BinOp) and type(node.op) in _SIZE_OPS:
        op, left, right = _SIZE_OPS[type(node.op)], _size_expr(node.left), _size_expr(node.right)
        return lambda env: op(left(env), right(env))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SIZE_CALLS
            and node.args and not node.keywords):
        fn, args = _SIZE_CALLS[node.func.id], [_size_expr(a) for a in node.args]
        return lambda env: fn(a(env) for a in args)
    raise ValueError("not a size expression")


def size_function(shape: str, stride: str, dtype: str) -> SizeFunction | None:
    """The bytes of `empty_strided((shape), (stride), dtype)` as a function of the symbols in them."""
    item = DTYPE_BYTES.get(dtype)
    if item is None or len(shape) > 10_000 or len(stride) > 10_000:
        return None
    try:
        sizes = [_size_expr(ast.parse(x, mode="eval").body) for x in split_top(shape)]
        strides = [_size_expr(ast.parse(x, mode="eval").body) for x in split_top(stride)]
    except (ValueError, SyntaxError, RecursionError):
        return None
    if len(sizes) != len(strides):
        return None
    symbols = tuple(sorted({n for x in split_top(shape) + split_top(stride) for n in _SYMBOL.findall(x)
                            if n not in _SIZE_CALLS}))

    def nbytes(env: Mapping[str, int]) -> int:
        dims = [f(env) for f in sizes]
        if any(d == 0 for d in dims):
            return 0
        return (1 + sum((d - 1) * st(env) for d, st in zip(dims, strides, strict=True))) * item

    return SizeFunction(symbols, nbytes)


def _first_reaching(f: Callable[[int], int], target: int, hi: int = 1 << 40) -> int:
    """The smallest s >= 1 with f(s) >= target, for a nondecreasing f (hi + 1 if none)."""
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if f(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo if f(lo) >= target else hi + 1


def solve_symbolic_sizes(sites: Sequence[tuple[str, SizeFunction | None, int]], cpu: bool) -> str:
    """Whether one call's symbolic allocations (buffer, size function, bytes the allocator handed out)
    are explained by
    some values of the size symbols: "" if so (or when a site cannot be checked), else which one is not.

    Sites with one unknown symbol are solved in order (each size is nondecreasing in its symbol):
    on the CPU the bytes are exact, on CUDA a block of 512-byte granules up to 1 MiB larger."""
    known: dict[str, tuple[int, int]] = {}  # symbol -> feasible [lo, hi]
    for buf, fn, block in sites:
        if fn is None:
            continue
        unknown = [s for s in fn.symbols if s not in known or known[s][0] != known[s][1]]
        if len(unknown) > 1:
            continue
        env = {s: known[s][0] for s in fn.symbols if s in known}
        try:
            if not unknown:
                size = fn(env)
                if not block_fits(size, block, cpu):
                    return f"{buf}: {block} bytes allocated, its size expression gives {size}"
                continue
            sym = unknown[0]

            def f(v: int, sym: str = sym, fn: SizeFunction = fn, env: dict[str, int] = env) -> int:
                return fn({**env, sym: v})

            if cpu:
                lo = _first_reaching(f, block)
                hi = _first_reaching(f, block + 1) - 1
            else:  # rounded up to 512 B and at most 1 MiB below the block
                lo = _first_reaching(f, max(block - CUDA_LARGE_SLACK - (CUDA_BLOCK - 1), 1))
                hi = _first_reaching(f, block + 1) - 1
            if sym in known:
                lo, hi = max(lo, known[sym][0]), min(hi, known[sym][1])
        except (ArithmeticError, KeyError, TypeError, ValueError, RecursionError):
            continue
        if lo > hi:
            return f"{buf}: {block} bytes allocated, no value of {sym} gives that size"
        known[sym] = (lo, hi)
    return ""


