"""The parser of the Python wrapper code Inductor generates for a compiled graph (pure, no torch).

The wrapper's `call(args)` is a straight-line program: `bufN = empty_strided_*(...)`
allocations, kernel launches, extern (aten) calls, aliases and reuses, `del` lines and a
`return (...)`. At run time, the allocations the wrapper makes itself happen in source order
and open no RecordFunction scope, while every extern call and (with profiler scopes on) every
Triton launch opens a scope named after the op or kernel. That is what lets the attribution join
runtime allocations to buffers (`parse_wrapper`), and memprof's estimate walk buffer lifetimes
(`memprof.sweep.estimate`); both read the wrapper through one lexer, `lex`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from memprof.analysis.sizes import SizeFunction, size_function, solve_symbolic_sizes, split_top, static_bytes

__all__ = ["AllocSite", "CallSite", "EmptyStrided", "Line", "WrapperCode", "check_symbolic_sizes", "lex",
           "match_empty_strided", "parse_wrapper", "scoped_calls"]

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_EMPTY_HEAD = re.compile(rf"^({_NAME}) = (?:empty_strided_(\w+)|(?:torch\.)?empty_strided)\(")
_DTYPE_ARG = re.compile(r"\s*torch\.(\w+)")
_DTYPE_KW = re.compile(r"dtype=torch\.(\w+)")
_ALIAS = re.compile(rf"^({_NAME}) = reinterpret_tensor\(({_NAME}),")
_COPY = re.compile(rf"^({_NAME}) = ({_NAME})(\[\d+\])?(;|$)")
_EXTERN_ASSIGN = re.compile(rf"^({_NAME}) = (torch\.ops\.)?(\w+)\.(\w+)(?:\.(\w+))?\(")
_BARE_EMPTY = re.compile(rf"^({_NAME}) = empty_strided\(")
_EXTERN_OUT = re.compile(r"^(extern_kernels|aten|torch\.ops\.aten)\.(\w+)(?:\.(\w+))?\((.*)\)\s*$")
_TRITON = re.compile(rf"^({_NAME})\.run\((.*)\)\s*$")
_CPP = re.compile(r"^(cpp_fused_\w+)\((.*)\)\s*$")
_RETURN = re.compile(r"^return \((.*)\)\s*$")
_ARGS = re.compile(rf"^((?:{_NAME}, )*{_NAME}),? = args$")
_OUT_KW = re.compile(rf"out=({_NAME})")
_BUF_REF = re.compile(rf"\b({_NAME})\b")
_SOURCE = re.compile(r"^# Topologically Sorted Source Nodes: \[(.*?)\](?:, Original ATen: \[(.*?)\])?")
_DEL = re.compile(rf"\bdel ({_NAME}(?:\s*,\s*{_NAME})*)")


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


@dataclass(frozen=True)
class Line:
    """One line of the wrapper's `call`, classified (`lex`). `kind` is one of:
    "source" (the "Topologically Sorted Source Nodes" comment: `names`), "args" (the inputs:
    `names`), "alloc" (`alloc`; `bare` for `empty_strided(`, which opens an aten scope), "alias"
    (`name = reinterpret_tensor(target, ...)`), "copy" (`name = target` or `target[i]`), "triton" and
    "cpp" (kernel `op` launched with `args`), "extern" (`name = namespace.op(args)`, a fresh tensor),
    "extern_out" (`namespace.op(args)`, writing `out` if given), "return" (`returns`: the name each
    returned value refers to, None for `None` or an expression) and "other"."""

    no: int  # line number in the source
    kind: str
    name: str = ""
    target: str = ""
    namespace: str = ""
    op: str = ""
    args: str = ""
    out: str = ""
    names: tuple[str, ...] = ()
    returns: tuple[str | None, ...] = ()
    alloc: EmptyStrided | None = None
    bare: bool = False
    dels: tuple[str, ...] = ()  # names a `del` on this line drops
    item: int = -1  # "copy" of one item of a tuple (`name = target[item]`), else -1
    overload: str = ""  # "extern" called as `torch.ops.<namespace>.<op>.<overload>(`: the overload


def _returned(text: str) -> tuple[str | None, ...]:
    out: list[str | None] = []
    for item in split_top(text):
        ref = _BUF_REF.match(item.replace("reinterpret_tensor(", "").strip()) if item != "None" else None
        out.append(ref.group(1) if ref else None)
    return tuple(out)


def _classify(no: int, stmt: str, dels: tuple[str, ...]) -> Line:
    if alloc := match_empty_strided(stmt):
        return Line(no, "alloc", alloc.name, args=stmt.split("(", 1)[1], alloc=alloc,
                    bare=bool(_BARE_EMPTY.match(stmt)), dels=dels)
    if (m := _ALIAS.match(stmt)) or (m := _COPY.match(stmt)):
        item = int(m.group(3)[1:-1]) if m.re is _COPY and m.group(3) else -1
        return Line(no, "alias" if m.re is _ALIAS else "copy", m.group(1), m.group(2), dels=dels, item=item)
    if m := _TRITON.match(stmt):
        return Line(no, "triton", op=m.group(1), args=m.group(2), dels=dels)
    if m := _CPP.match(stmt):
        return Line(no, "cpp", op=m.group(1), args=m.group(2), dels=dels)
    m = _EXTERN_ASSIGN.match(stmt)
    if m and (m.group(2) or m.group(3) in ("aten", "extern_kernels")):
        return Line(no, "extern", m.group(1), namespace=m.group(3), op=m.group(4), args=stmt.split("(", 1)[1],
                    dels=dels, overload=(m.group(5) or "") if m.group(2) else "")
    if m := _EXTERN_OUT.match(stmt):
        out = _OUT_KW.search(m.group(4))
        return Line(no, "extern_out", namespace=m.group(1), op=m.group(2), args=m.group(4),
                    out=out.group(1) if out else "", dels=dels)
    if m := _RETURN.match(stmt):
        return Line(no, "return", returns=_returned(m.group(1)), dels=dels)
    return Line(no, "other", dels=dels)


@lru_cache(maxsize=16)
def lex(source: str) -> tuple[Line, ...]:
    """The lines of the wrapper's `call` (none when it has no Python `call`), classified; a
    statement is read up to its first `;`, a `del` anywhere on the line. Kept for the last few
    wrappers: the join and memprof's estimate read the same ones."""
    out: list[Line] = []
    for no, text in _call_body(source):
        if text.startswith("#"):
            m = _SOURCE.match(text)
            if m:
                out.append(Line(no, "source", names=tuple(s.strip() for s in m.group(1).split(",") if s.strip())))
            continue
        if m := _ARGS.match(text):
            out.append(Line(no, "args", names=tuple(s.strip() for s in m.group(1).split(","))))
            continue
        dels = tuple(n.strip() for d in _DEL.finditer(text) for n in d.group(1).split(","))
        out.append(_classify(no, text.split(";")[0].strip(), dels))
    return tuple(out)


def _unsupported(source: str) -> list[str]:
    """What keeps the 1:1 allocation join from being used on this wrapper."""
    out: list[str] = []
    if "def call(self, args)" not in source and "def call(args)" not in source:
        out.append("no Python wrapper call() (cpp_wrapper or an unknown wrapper)")
    if re.search(r"^\s*def partition_\d+\(", source, re.M):
        out.append("graph partitions (CUDA graphs)")
    if "alloc_from_pool(" in source.split("def call", 1)[-1]:
        out.append("memory planning (alloc_from_pool)")
    return out


class _Parse:
    """The state of one `parse_wrapper` pass."""

    def __init__(self) -> None:
        self.inputs: tuple[str, ...] = ()
        self.allocs: list[AllocSite] = []
        self.calls: list[CallSite] = []
        self.outputs: tuple[str | None, ...] = ()
        self.alias_of: dict[str, str] = {}
        self.writer: dict[str, int] = {}
        self.pending_source: tuple[str, ...] = ()
        self.known: set[str] = set()

    def root(self, name: str) -> str:
        while name in self.alias_of:
            name = self.alias_of[name]
        return name

    def call(self, kernel: str, scope: str | None, kind: str, out: str | None, argtext: str, line: int) -> None:
        names = tuple(n for n in _BUF_REF.findall(argtext) if n in self.known)
        call = CallSite(len(self.calls), kernel, scope, kind, out, names, self.pending_source, line)
        self.calls.append(call)
        for n in names:
            self.writer.setdefault(self.root(n), call.index)
        self.pending_source = ()

    def line(self, ln: Line) -> None:
        k = ln.kind
        if k == "source":
            self.pending_source = ln.names
        elif k == "args" and not self.inputs:
            self.inputs = ln.names
            self.known.update(ln.names)
        elif k == "alloc" and ln.alloc is not None and ln.alloc.device is not None:
            a = ln.alloc
            self.allocs.append(AllocSite(a.name, static_bytes(a.shape, a.stride, a.dtype), f"({a.shape})", a.dtype,
                                         ln.no, f"({a.stride})"))
            self.known.add(a.name)
        elif k == "alloc" and ln.bare:  # empty_strided( opens an aten::empty_strided scope, unlike empty_strided_<dev>
            self.known.add(ln.name)
            self.call("empty_strided", "aten::empty_strided", "extern", ln.name, ln.args, ln.no)
        elif k == "alias" or (k == "copy" and ln.target in self.known):
            self.alias_of[ln.name] = ln.target
            self.known.add(ln.name)
        elif k in ("triton", "cpp"):
            self.call(ln.op, ln.op if k == "triton" else None, k, None, ln.args, ln.no)
        elif k == "extern":
            self.known.add(ln.name)
            namespace = "aten" if ln.namespace == "extern_kernels" else ln.namespace
            self.call(ln.op, f"{namespace}::{ln.op}", "extern", ln.name, ln.args, ln.no)
        elif k == "extern_out":
            self.call(ln.op, f"aten::{ln.op}", "extern", None, ln.args, ln.no)
            if ln.out:
                self.writer.setdefault(self.root(ln.out), len(self.calls) - 1)
        elif k == "return":
            self.outputs = tuple(self.root(r) if r is not None else None for r in ln.returns)


def check_symbolic_sizes(sites: Sequence[tuple[AllocSite, int]], cpu: bool) -> str:
    """Whether one call's symbolic allocation sites, with the bytes the allocator handed out, are
    explained by some values of the size symbols ("" if so, else which one is not:
    `sizes.solve_symbolic_sizes`)."""
    return solve_symbolic_sizes([(a.buf, a.size_of, block) for a, block in sites], cpu)


# the matrix multiplies Inductor calls as extern kernels writing `out=` a buffer it made: once the
# graph has run they allocate nothing a scope must name (cuBLAS takes its workspace at the first on a
# stream; the CPU's half-precision ones allocate a float accumulator, which memprof measures once per
# call signature: `memprof.sweep.probe`)
EXTERN_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
_ASSIGNS = re.compile(rf"^{_NAME} = ")


def scoped_calls(source: str) -> tuple[str, ...] | None:
    """The operator overloads (`namespace.op.overload`) of the wrapper's calls that return fresh
    tensors: after a graph's first call, the only op scopes the join needs inside a call of it (the
    wrapper's own allocations open none, and its `out=` matmuls allocate nothing). None where another
    line may allocate with no such scope to show it: a fresh tensor from another kind of call,
    `empty_strided(` (it opens aten's scope), an `out=` call that is not a matmul, an assignment this
    lexer does not know, or a wrapper the join cannot read."""
    if _unsupported(source):
        return None
    text = source.splitlines()
    ops: list[str] = []
    for ln in lex(source):
        if ln.kind == "extern" and ln.overload:
            ops.append(f"{ln.namespace}.{ln.op}.{ln.overload}")
        elif _may_allocate_unseen(ln, text[ln.no - 1].strip()):
            return None
    return tuple(dict.fromkeys(ops))


def _may_allocate_unseen(ln: Line, stmt: str) -> bool:
    """Whether a line may allocate with no op scope of memprof's around it (`scoped_calls`)."""
    if ln.kind == "other":
        return bool(_ASSIGNS.match(stmt)) and "= get_raw_stream(" not in stmt
    return (ln.kind == "alloc" and ln.bare) or ln.kind == "extern" or (ln.kind == "extern_out" and
                                                                      ln.op not in EXTERN_MATMULS)


def parse_wrapper(source: str) -> WrapperCode:
    """Parse an Inductor Python wrapper module; never raises on unexpected code (it is skipped)."""
    state = _Parse()
    for ln in lex(source):
        state.line(ln)
    return WrapperCode(state.inputs, tuple(state.allocs), tuple(state.calls), state.outputs, state.alias_of,
                       state.writer, tuple(_unsupported(source)))
