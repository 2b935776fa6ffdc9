"""Compile plans: what the partitioner decided for each compiled forward/backward pair (pure data).

Recorded by `memprof.torch_hooks.plan_recorder` while a capture runs and stored in the .memprof file
(`plans.json`, plus each compiled graph's wrapper source under `wrappers/`). Everything here
is plain data with JSON round-trips; nothing imports torch.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any, NamedTuple, overload

from memprof.analysis.wrapper_code import WrapperCode, parse_wrapper


@dataclass(frozen=True)
class FxNode:
    """One node of a partitioned FX graph."""

    name: str
    op: str  # placeholder, call_function, output, get_attr
    target: str
    shape: list[int] | None
    dtype: str | None
    bytes: int | None  # size of the value (sum over tuple outputs); None if symbolic
    users: list[str]
    module_path: str  # e.g. "layers.3.mlp.down_proj" ("" when unknown)
    source: str  # the pre-partition (Dynamo) node it came from, when known
    random: bool = False  # draws random numbers (dropout, rand*, inductor_random, ...)
    mask: bool = False  # a boolean value computed from a random op (a dropout mask)
    # for ops Inductor runs as fallback kernels: the call (op, argument shapes/strides/dtypes,
    # constants) as JSON, so memprof's estimate can measure the kernel's scratch memory
    call: str = ""
    # the byte count as an expression in the graph's size symbols ("2048*s27") when it is symbolic
    # (dynamic shapes; `bytes` is then None), "" when static
    size_expr: str = ""
    # bytes of each item of a tuple value (`bytes` is their sum), [] for a single value; plans an
    # earlier memprof recorded lack it (the estimate then holds a tuple as one storage)
    items: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FxGraph:
    nodes: list[FxNode]

    @cached_property
    def by_name(self) -> dict[str, FxNode]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}


@dataclass(frozen=True)
class RecomputedNode:
    """A forward value the backward recomputes: where it is defined and first/last used (node indices)."""

    name: str
    defined_at: int
    first_use: int
    last_use: int
    bytes: int | None


@dataclass(frozen=True)
class Plan:
    """One forward/backward pair as the partitioner produced it."""

    index: int
    backend: str  # "inductor", "aot_eager", ...
    partitioner: str  # the function that partitioned
    budget: float
    num_fwd_outputs: int
    forward: FxGraph
    backward: FxGraph
    saved: list[str]  # forward outputs after num_fwd_outputs (what the backward receives)
    recomputed: list[str]  # forward nodes the backward computes again (same name in both graphs)
    recompute_sites: list[RecomputedNode]  # where the backward defines each and first/last uses it
    random_ops: list[str]  # random forward nodes
    recomputed_random: list[str]  # random nodes that the backward runs again (fresh randomness)
    masks: list[str]  # dropout masks and the random numbers made from a seed (forward node names), saved or recomputed
    status: str = "ok"  # "ok", or why the stock partitioner ran instead of memprof's wrapper
    notes: list[str] = field(default_factory=list)
    remat: dict[str, Any] | None = None  # what memprof's remat pass did (RematReport.to_json()), if it ran
    knapsack_peak: float | None = None  # KnapsackEvaluator's peak for the knapsack's choice (normalized units)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> Plan:
        def graph(g: dict[str, Any]) -> FxGraph:  # fields a later memprof adds are skipped
            return FxGraph([FxNode(**n) if n.keys() <= _FX_FIELDS else FxNode(**{k: v for k, v in n.items()
                                                                                 if k in _FX_FIELDS})
                            for n in g["nodes"]])

        return Plan(
            index=int(d["index"]), backend=str(d["backend"]), partitioner=str(d.get("partitioner", "")),
            budget=float(d["budget"]), num_fwd_outputs=int(d["num_fwd_outputs"]),
            forward=graph(d["forward"]), backward=graph(d["backward"]), saved=list(d["saved"]),
            recomputed=list(d["recomputed"]),
            recompute_sites=[RecomputedNode(**{k: v for k, v in r.items() if k in _RECOMPUTED_FIELDS})
                             for r in d["recompute_sites"]], random_ops=list(d["random_ops"]),
            recomputed_random=list(d["recomputed_random"]), masks=list(d.get("masks", [])),
            status=str(d.get("status", "ok")), notes=list(d.get("notes", [])), remat=d.get("remat"),
            knapsack_peak=None if d.get("knapsack_peak") is None else float(d["knapsack_peak"]),
        )


@dataclass(frozen=True)
class CompiledGraph:
    """One graph Inductor compiled: its runtime scope key, role, plan and wrapper code."""

    key: str  # `## Call CompiledFxGraph <key> ##`
    role: str  # "forward", "backward" or "inference"
    plan: int | None  # index into Capture.plans
    graph_id: int | None
    origins: dict[str, list[str]]  # buffer -> FX nodes it computes (post-grad graph order)
    source: str  # the wrapper module's Python source
    notes: list[str] = field(default_factory=list)
    inductor_estimate: int | None = None  # Inductor's estimate_peak_memory for this graph (lowest of its calls)
    inductor_estimate_kept: int | None = None  # the same buffer timeline with graph outputs live to the end

    @cached_property
    def wrapper(self) -> WrapperCode:
        return parse_wrapper(self.source)

    @property
    def scope_name(self) -> str:
        return f"## Call CompiledFxGraph {self.key} ##"

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "source"}
        return d

    @staticmethod
    def from_json(d: dict[str, Any], source: str) -> CompiledGraph:
        def opt_int(key: str) -> int | None:
            return None if d.get(key) is None else int(d[key])

        return CompiledGraph(
            key=str(d["key"]), role=str(d["role"]), plan=None if d.get("plan") is None else int(d["plan"]),
            graph_id=None if d.get("graph_id") is None else int(d["graph_id"]),
            origins={str(k): list(v) for k, v in d.get("origins", {}).items()}, source=source,
            notes=list(d.get("notes", [])),
            inductor_estimate=opt_int("inductor_estimate"), inductor_estimate_kept=opt_int("inductor_estimate_kept"),
        )


class KnownTensor(NamedTuple):
    """A tensor whose role is known by pointer from a given time: a parameter (or buffer), a
    gradient or an optimizer state tensor, as seen in the modules and optimizers."""

    t_ns: int  # when it was seen (steady clock)
    device: str
    ptr: int  # its storage's data pointer
    bytes: int  # its storage's bytes
    category: str  # "parameter", "gradient" or "optimizer_state"
    name: str  # "layers.3.mlp.w", "layers.3.mlp.w.grad", "layers.3.mlp.w.exp_avg"

    def to_json(self) -> list[Any]:
        return list(self)

    @classmethod
    def from_json(cls, t: Sequence[Any]) -> KnownTensor:
        return cls(int(t[0]), str(t[1]), int(t[2]), int(t[3]), str(t[4]), str(t[5]))


class KnownTensors(Sequence[KnownTensor]):
    """Known tensors as a capture records them, in columns: a tuple of six fields and its integers
    take about 200 bytes a record where these columns take 28 (and one label a name). Reads as a
    sequence of `KnownTensor`. The records a spill holds may be let go (`release_before`): on the
    CPU, every step's gradients lie at new addresses, a record each, and a long run would hold them
    all; reading a released record raises IndexError."""

    def __init__(self, tensors: Iterable[KnownTensor] = ()) -> None:
        self._t, self._ptr, self._bytes, self._label = array("q"), array("Q"), array("q"), array("I")
        self._released = 0  # records let go from the start
        self._labels: list[tuple[str, str, str]] = []  # (device, category, name)
        self._label_ids: dict[tuple[str, str, str], int] = {}
        self._labels_json: list[tuple[str, str]] = []  # (device, "category,name") as JSON, for `json_rows`
        for t in tensors:
            self.add(*t)

    def add(self, t_ns: int, device: str, ptr: int, nbytes: int, category: str, name: str) -> None:
        label = (device, category, name)
        at = self._label_ids.get(label)
        if at is None:
            at = self._label_ids[label] = len(self._labels)
            self._labels.append(label)
        self._t.append(t_ns)
        self._ptr.append(ptr)
        self._bytes.append(nbytes)
        self._label.append(at)  # (last: the spill's thread reads up to its length while records are added)

    def __len__(self) -> int:
        return self._released + len(self._label)

    @property
    def released(self) -> int:
        """How many records, from the start, were let go."""
        return self._released

    def release_before(self, n: int) -> None:
        """Let the first `n` records go (a spill holds them). Called by one thread while another adds:
        each column loses its first records, and records are added at the end."""
        k = min(n, len(self)) - self._released
        if k > 0:
            for col in (self._t, self._ptr, self._bytes, self._label):
                del col[:k]
            self._released += k

    @overload
    def __getitem__(self, i: int) -> KnownTensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[KnownTensor]: ...

    def __getitem__(self, i: int | slice) -> KnownTensor | list[KnownTensor]:
        if isinstance(i, slice):
            return [self._at(k) for k in range(*i.indices(len(self)))]
        return self._at(range(len(self))[i])

    def _at(self, k: int) -> KnownTensor:
        if k < self._released:
            raise IndexError(f"known tensor {k} was let go (the spill holds the first {self._released:,})")
        k -= self._released
        device, category, name = self._labels[self._label[k]]
        return KnownTensor(self._t[k], device, self._ptr[k], self._bytes[k], category, name)

    def json_rows(self, start: int, stop: int) -> str:
        """Records [start, stop) as the JSON list of their `to_json` (what the spill writes), made
        from the columns: a ring's spill writes every record again each time it is rewritten, on a
        thread that shares the interpreter with the script's."""
        if start < self._released:
            raise IndexError(f"known tensor {start} was let go (the spill holds the first {self._released:,})")
        a, b = start - self._released, max(start, stop) - self._released
        encoded = self._labels_json  # (each label encoded once: a run has hundreds, its rows thousands)
        for d, c, n in self._labels[len(encoded):]:
            encoded.append((json.dumps(d), f"{json.dumps(c)},{json.dumps(n)}"))
        columns = zip(self._t[a:b], self._ptr[a:b], self._bytes[a:b], self._label[a:b], strict=True)
        return "[" + ",".join([f"[{t},{encoded[lab][0]},{p},{n},{encoded[lab][1]}]" for t, p, n, lab in columns]) + "]"

    def pruned(self, before_ns: int) -> KnownTensors | None:
        """The records a capture that stores only the events from `before_ns` on still needs, or
        None where that is all of them: every one seen from then on, and of those seen earlier the
        last at each address. A record names the block live at its address when it was seen; a block
        stored from `before_ns` on is named only by later records, and a block carried in from before
        (allocated earlier, still live) by the last earlier record at its address, if any names it.
        On the columns: a ring prunes every few steps on the script's thread, where a record object
        each took milliseconds a step and fed Python's collector. Only records still held (none
        released to a spill) can be pruned."""
        import numpy as np

        if self._released:
            raise ValueError("known tensors released to a spill cannot be pruned")
        n = len(self._label)  # (read first: another thread may add records meanwhile)
        if n == 0:
            return None
        t = np.frombuffer(self._t[:n], dtype=np.int64)
        ptr = np.frombuffer(self._ptr[:n], dtype=np.uint64)
        label = np.frombuffer(self._label[:n], dtype=np.uint32)
        devices = {d: i for i, d in enumerate(dict.fromkeys(lab[0] for lab in self._labels))}
        device = np.asarray([devices[lab[0]] for lab in self._labels], dtype=np.int32)[label]
        early = np.flatnonzero(t < before_ns)[::-1]  # the latest first: np.unique keeps each key's first
        keep = t >= before_ns
        for d in range(len(devices)):  # (a few devices; np.unique of one column, not of rows)
            mine = early[device[early] == d]
            keep[mine[np.unique(ptr[mine], return_index=True)[1]]] = True
        if keep.all():
            return None
        out = KnownTensors()
        out._labels, out._label_ids = list(self._labels), dict(self._label_ids)
        out._labels_json = list(self._labels_json)
        for src, dst in ((self._t, out._t), (self._ptr, out._ptr), (self._bytes, out._bytes),
                         (self._label, out._label)):
            dst.frombytes(np.frombuffer(src[:n], dtype=src.typecode)[keep].tobytes())
        return out


_FX_FIELDS = {f.name for f in fields(FxNode)}
_RECOMPUTED_FIELDS = {f.name for f in fields(RecomputedNode)}
_PREFIX = re.compile(r"^L\['(?:self|args)'\](?:\[\d+\])?\.?")


def module_path(raw: str) -> str:
    """Normalize a Dynamo module path ("L['self'].layers[3].mlp") to "layers.3.mlp"."""
    path = _PREFIX.sub("", raw)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    path = re.sub(r"^_orig_mod\.", "", path)
    return path.strip(".")


def layer_of(path: str) -> str:
    """The layer a module path belongs to: up to the first numeric index ("layers.3"), else its head."""
    if not path:
        return ""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]
