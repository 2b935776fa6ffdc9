"""A parser for the Python wrapper code Inductor generates for a compiled graph (pure, no torch).

The wrapper's `call(args)` is a straight-line program: `bufN = empty_strided_*(...)`
allocations, kernel launches, extern (aten) calls, aliases and reuses, `del` lines and a
`return (...)`. At run time, the allocations the wrapper makes itself happen in source order
and open no RecordFunction scope, while every extern call and (with profiler scopes on) every
Triton launch opens a scope named after the op or kernel. That is what lets
`memprof.attribution` join runtime allocations to buffers. Only what the join needs is parsed.
"""

from __future__ import annotations

import re
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
                                    alloc.dtype, line_no))
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
