"""A parser for the Python wrapper code Inductor generates for a compiled graph (pure, no torch).

The wrapper's `call(args)` is a straight-line program: `bufN = empty_strided_*(...)`
allocations, kernel launches, extern (aten) calls, aliases and reuses, `del` lines and a
`return (...)`. At run time, the allocations the wrapper makes itself happen in source order
and open no RecordFunction scope, while every extern call and (with profiler scopes on) every
Triton launch opens a scope named after the op or kernel. That is what lets
`memprof.attribution` join runtime allocations to buffers. Only what the join needs is parsed.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

# Bytes per element of the dtypes Inductor writes as `torch.<name>`.
DTYPE_BYTES = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16, "complex32": 4,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_EMPTY_HEAD = re.compile(rf"^({_NAME}) = (?:empty_strided_(\w+)|(?:torch\.)?empty_strided)\(")
_DTYPE_ARG = re.compile(r"\s*torch\.(\w+)")
_DTYPE_KW = re.compile(r"dtype=torch\.(\w+)")
_ALIAS = re.compile(rf"^({_NAME}) = reinterpret_tensor\(({_NAME}),")
_COPY = re.compile(rf"^({_NAME}) = ({_NAME})(\[\d+\])?(;|$)")
_EXTERN_ASSIGN = re.compile(rf"^({_NAME}) = (torch\.ops\.)?(\w+)\.(\w+)(?:\.(\w+))?\(")
_TORCH_EMPTY = re.compile(rf"^({_NAME}) = empty_strided\(")
_EXTERN_OUT = re.compile(r"^(extern_kernels|aten|torch\.ops\.aten)\.(\w+)(?:\.(\w+))?\((.*)\)\s*$")
_TRITON = re.compile(rf"^({_NAME})\.run\((.*)\)\s*$")
_CPP = re.compile(r"^(cpp_fused_\w+)\((.*)\)\s*$")
_RETURN = re.compile(r"^return \((.*)\)\s*$")
_ARGS = re.compile(rf"^((?:{_NAME}, )*{_NAME}),? = args$")
_OUT_KW = re.compile(rf"out=({_NAME})")
_BUF_REF = re.compile(rf"\b({_NAME})\b")
_SOURCE = re.compile(r"^# Topologically Sorted Source Nodes: \[(.*?)\](?:, Original ATen: \[(.*?)\])?")


@dataclass(frozen=True)
class EmptyStrided:
    """`buf = empty_strided_<device>((sizes), (strides), torch.<dtype>)`, or the same through
    `torch.empty_strided(..., dtype=torch.<dtype>)` (device None)."""

    name: str
    device: str | None
    shape: str  # the text between the parentheses
    stride: str
    dtype: str


def _group_end(text: str, i: int) -> int:
    """Index of the parenthesis closing the one at text[i], or -1 (one pass: linear in the line)."""
    depth = 0
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return j
    return -1


def match_empty_strided(text: str) -> EmptyStrided | None:
    """An allocation line of the wrapper, parsed in linear time (a regex with two lazy groups
    backtracks quadratically on a line of many `(a), (` pieces)."""
    head = _EMPTY_HEAD.match(text)
    if head is None:
        return None
    groups: list[str] = []
    pos = head.end()
    for _ in range(2):
        if not text.startswith("(", pos):
            return None
        end = _group_end(text, pos)
        if end < 0:
            return None
        groups.append(text[pos + 1 : end])
        pos = end + 1
        if not text.startswith(",", pos):
            return None
        pos += 1
        while pos < len(text) and text[pos] == " ":
            pos += 1
    device = head.group(2)
    m = _DTYPE_ARG.match(text, pos) if device is not None else _DTYPE_KW.search(text, pos)
    if m is None:
        return None
    return EmptyStrided(head.group(1), device, groups[0], groups[1], m.group(1))


@dataclass(frozen=True)
class AllocSite:
    """An allocation the wrapper makes itself (`bufN = empty_strided_*`)."""

    buf: str
    nbytes: int | None  # None when a size is symbolic
    shape: str
    dtype: str
    line: int
    stride: str = ""  # the strides' text, "(...)"

    @cached_property
    def size_of(self) -> SizeFunction | None:
        """For a symbolic site, its bytes as a function of the size symbols' values (None: static, or
        an expression memprof does not evaluate)."""
        if self.nbytes is not None:
            return None
        return size_function(self.shape[1:-1], self.stride[1:-1], self.dtype)


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
        sizes = [_size_expr(ast.parse(x, mode="eval").body) for x in _split_top(shape)]
        strides = [_size_expr(ast.parse(x, mode="eval").body) for x in _split_top(stride)]
    except (ValueError, SyntaxError, RecursionError):
        return None
    if len(sizes) != len(strides):
        return None
    symbols = tuple(sorted({n for x in _split_top(shape) + _split_top(stride) for n in _BUF_REF.findall(x)
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


def check_symbolic_sizes(sites: Sequence[tuple[AllocSite, int]], cpu: bool) -> str:
    """Whether one call's symbolic allocations (site, bytes the allocator handed out) are explained by
    some values of the size symbols: "" if so (or when a site cannot be checked), else which one is not.

    Sites with one unknown symbol are solved in order (each size is nondecreasing in its symbol):
    on the CPU the bytes are exact, on CUDA a block of 512-byte granules up to 1 MiB larger."""
    known: dict[str, tuple[int, int]] = {}  # symbol -> feasible [lo, hi]
    for site, block in sites:
        fn = site.size_of
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
                    return f"{site.buf}: {block} bytes allocated, its size expression gives {size}"
                continue
            sym = unknown[0]

            def f(v: int, sym: str = sym, fn: SizeFunction = fn, env: dict[str, int] = env) -> int:
                return fn({**env, sym: v})

            if cpu:
                lo = _first_reaching(f, block)
                hi = _first_reaching(f, block + 1) - 1
            else:  # rounded up to 512 B and at most 1 MiB below the block
                lo = _first_reaching(f, max(block - (1 << 20) - 511, 1))
                hi = _first_reaching(f, block + 1) - 1
            if sym in known:
                lo, hi = max(lo, known[sym][0]), min(hi, known[sym][1])
        except (ArithmeticError, KeyError, TypeError, ValueError, RecursionError):
            continue
        if lo > hi:
            return f"{site.buf}: {block} bytes allocated, no value of {sym} gives that size"
        known[sym] = (lo, hi)
    return ""


def block_fits(nbytes: int | None, block: int, cpu: bool) -> bool:
    """Whether an allocation of `nbytes` (None: unknown, any) can be a block of `block` bytes: the
    same on the CPU; on CUDA the caching allocator's 512-byte granules, and large blocks are not
    split below 1 MiB."""
    if nbytes is None:
        return True
    if cpu:
        return block == nbytes
    rounded = max(512, (nbytes + 511) // 512 * 512)
    return rounded <= block <= rounded + (1 << 20)


@dataclass(frozen=True)
class CallSite:
    """A kernel launch or extern call, with the runtime scope it opens (None: no scope)."""

    index: int
    kernel: str  # Triton/C++ kernel name, or the aten op for extern calls
    scope: str | None  # RecordFunction name at run time ("aten::mm", the Triton kernel name)
    kind: str  # "triton", "cpp", "extern"
    out: str | None  # buffer a call returns freshly (`bufN = aten.op(...)`), None for out= calls
    args: tuple[str, ...]  # buffer and input names it reads or writes
    source_nodes: tuple[str, ...]  # the "Topologically Sorted Source Nodes" comment before it
    line: int


@dataclass(frozen=True)
class WrapperCode:
    """The parts of a wrapper's `call` that the allocation join uses."""

    inputs: tuple[str, ...]
    allocs: tuple[AllocSite, ...]
    calls: tuple[CallSite, ...]
    outputs: tuple[str | None, ...]  # root buffer or input name per returned value
    alias_of: dict[str, str] = field(default_factory=dict)  # buffer -> the buffer it aliases or reuses
    writer: dict[str, int] = field(default_factory=dict)  # root buffer -> index of the first call using it
    unsupported: tuple[str, ...] = ()  # reasons the 1:1 allocation join cannot be used

    def root(self, name: str) -> str:
        """The allocation a buffer name refers to (following aliases and reuses)."""
        seen = 0
        while name in self.alias_of and seen < 10_000:
            name = self.alias_of[name]
            seen += 1
        return name

    @cached_property
    def calls_by_scope(self) -> dict[str, list[int]]:
        """Call indices per runtime scope name, in order (the k-th scope of a name is the k-th call)."""
        out: dict[str, list[int]] = {}
        for c in self.calls:
            if c.scope is not None:
                out.setdefault(c.scope, []).append(c.index)
        return out

    @property
    def expected_allocs(self) -> list[AllocSite]:
        """Allocation sites that really reach the allocator (zero-byte tensors never do)."""
        return [a for a in self.allocs if a.nbytes != 0]


def _nbytes(shape: str, stride: str, dtype: str) -> int | None:
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


def _split_top(text: str) -> list[str]:
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


def _call_body(source: str) -> list[tuple[int, str]]:
    """The stripped lines of the `call` function (or of the whole module when there is none)."""
    lines = source.splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r"^\s*def call\(self, args\):", ln)), None)
    if start is None:
        start = next((i for i, ln in enumerate(lines) if re.match(r"^\s*def call\(args\):", ln)), None)
    if start is None:
        return []
    indent = len(lines[start]) - len(lines[start].lstrip())
    body: list[tuple[int, str]] = []
    for i in range(start + 1, len(lines)):
        ln = lines[i]
        if ln.strip() and len(ln) - len(ln.lstrip()) <= indent:
            break
        if ln.strip():
            body.append((i + 1, ln.strip()))
    return body


def parse_wrapper(source: str) -> WrapperCode:
    """Parse an Inductor Python wrapper module; never raises on unexpected code (it is skipped)."""
    unsupported: list[str] = []
    if "def call(self, args)" not in source and "def call(args)" not in source:
        unsupported.append("no Python wrapper call() (cpp_wrapper or an unknown wrapper)")
    if re.search(r"^\s*def partition_\d+\(", source, re.M):
        unsupported.append("graph partitions (CUDA graphs)")
    if "alloc_from_pool(" in source.split("def call", 1)[-1]:
        unsupported.append("memory planning (alloc_from_pool)")
    inputs: tuple[str, ...] = ()
    allocs: list[AllocSite] = []
    calls: list[CallSite] = []
    outputs: tuple[str | None, ...] = ()
    alias_of: dict[str, str] = {}
    writer: dict[str, int] = {}
    pending_source: tuple[str, ...] = ()
    known: set[str] = set()

    def root(name: str) -> str:
        while name in alias_of:
            name = alias_of[name]
        return name

    def add_call(kernel: str, scope: str | None, kind: str, out: str | None, argtext: str, line: int) -> None:
        nonlocal pending_source
        names = tuple(n for n in _BUF_REF.findall(argtext) if n in known)
        call = CallSite(len(calls), kernel, scope, kind, out, names, pending_source, line)
        calls.append(call)
        for n in names:
            writer.setdefault(root(n), call.index)
        pending_source = ()

    for line_no, text in _call_body(source):
        if text.startswith("#"):
            m = _SOURCE.match(text)
            if m:
                pending_source = tuple(s.strip() for s in m.group(1).split(",") if s.strip())
            continue
        m = _ARGS.match(text)
        if m and not inputs:
            inputs = tuple(s.strip() for s in m.group(1).split(","))
            known.update(inputs)
            continue
        alloc = match_empty_strided(text)
        if alloc is not None and alloc.device is not None:
            allocs.append(AllocSite(alloc.name, _nbytes(alloc.shape, alloc.stride, alloc.dtype), f"({alloc.shape})",
                                    alloc.dtype, line_no, f"({alloc.stride})"))
            known.add(alloc.name)
            continue
        m = _ALIAS.match(text)
        if m:
            alias_of[m.group(1)] = m.group(2)
            known.add(m.group(1))
            continue
        m = _COPY.match(text)
        if m and m.group(2) in known:
            alias_of[m.group(1)] = m.group(2)
            known.add(m.group(1))
            continue
        m = _TRITON.match(text)
        if m:
            add_call(m.group(1), m.group(1), "triton", None, m.group(2), line_no)
            continue
        m = _CPP.match(text)
        if m:
            add_call(m.group(1), None, "cpp", None, m.group(2), line_no)
            continue
        m = _TORCH_EMPTY.match(text)
        if m:  # torch.empty_strided opens an aten::empty_strided scope, unlike empty_strided_<device>
            known.add(m.group(1))
            add_call("empty_strided", "aten::empty_strided", "extern", m.group(1), text.split("(", 1)[1], line_no)
            continue
        m = _EXTERN_ASSIGN.match(text)
        if m and (m.group(2) or m.group(3) in ("aten", "extern_kernels")):
            name, ns, op = m.group(1), m.group(3), m.group(4)
            known.add(name)
            namespace = "aten" if ns == "extern_kernels" else ns
            add_call(op, f"{namespace}::{op}", "extern", name, text.split("(", 1)[1], line_no)
            continue
        m = _EXTERN_OUT.match(text)
        if m:
            ns, op, _overload, argtext = m.groups()
            out = _OUT_KW.search(argtext)
            add_call(op, f"aten::{op}", "extern", None, argtext, line_no)
            if out:
                writer.setdefault(root(out.group(1)), len(calls) - 1)
            continue
        m = _RETURN.match(text)
        if m:
            outs: list[str | None] = []
            for item in _split_top(m.group(1)):
                if item == "None":
                    outs.append(None)
                    continue
                ref = _BUF_REF.match(item.replace("reinterpret_tensor(", "").strip())
                outs.append(root(ref.group(1)) if ref else None)
            outputs = tuple(outs)
    return WrapperCode(inputs, tuple(allocs), tuple(calls), outputs, alias_of, writer, tuple(unsupported))
