"""The labels attribution gives every allocation (category, FX node, layer, kernel) and the
shared state the labelling passes write them into."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from memprof._events import Events, Kind
from memprof.analysis.scopes import ScopeIndex
from memprof.analysis.timeline import Timeline
from memprof.plans import CompiledGraph, Plan, layer_of


class Category(enum.IntEnum):
    """Why an allocation exists (a refinement of torch.profiler's memory categories)."""

    PARAMETER = 0
    GRADIENT = 1
    OPTIMIZER_STATE = 2
    INPUT = 3
    SAVED_ACTIVATION = 4
    RECOMPUTED = 5
    RNG_MASK = 6  # dropout masks, and the random values or seeds they come from
    TEMPORARY = 7
    WORKSPACE = 8
    UNATTRIBUTED = 9
    # distributed (memprof.analysis.distributed); under FSDP2, PARAMETER and GRADIENT are the rank's shards
    UNSHARDED_PARAMETER = 10  # FSDP2's all-gathered parameters, between all-gather and reshard
    UNSHARDED_GRADIENT = 11  # gradients of unsharded parameters, until reduce-scattered
    ALL_GATHER = 12  # FSDP2's all-gather buffers
    REDUCE_SCATTER = 13  # FSDP2's reduce-scatter buffers
    DDP_BUCKET = 14  # DDP's gradient buckets (the reducer's flat gradient copies)


CATEGORIES = tuple(c.name.lower() for c in Category)
BEFORE_CAPTURE = "(allocated before the capture)"
# known tensors name their category: the modules' and optimizers' (parameter, gradient,
# optimizer_state), or any category a memory snapshot's entries carry (`memprof.snapshot`)
CATEGORY_OF_KNOWN = {c.name.lower(): c for c in Category}


@dataclass(frozen=True)
class CallJoin:
    """How one compiled-graph call was attributed."""

    key: str
    role: str  # forward, backward, inference, unknown
    thread: int
    begin_row: int
    end_row: int
    allocations: int
    level: str  # "buffer" (joined and verified) or "kernel"
    reason: str = ""  # why the call fell back to kernel level
    # allocations made directly in the call beyond those its wrapper code makes (a kernel's or a
    # library's own buffers: an estimate that walks the wrapper code counts them only where memprof
    # measured the kernel, `memprof.sweep.probe`)
    unseen: int = 0


@dataclass(frozen=True)
class Labels:
    """Per timeline position: category and label ids (frees carry their allocation's labels)."""

    category: np.ndarray
    node: np.ndarray
    layer: np.ndarray
    kernel: np.ndarray
    names: list[str]
    calls: list[CallJoin] = field(default_factory=list)
    # blocks live when the capture started (CUDA snapshot): size, position of their free
    # (len(timeline) if never freed), and labels like the arrays above
    pre_size: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pre_free: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pre_category: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    pre_node: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    pre_layer: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    pre_kernel: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def label(self, by: str) -> np.ndarray:
        return {"node": self.node, "layer": self.layer, "kernel": self.kernel}[by]

    def pre_label(self, by: str) -> np.ndarray:
        return {"node": self.pre_node, "layer": self.pre_layer, "kernel": self.pre_kernel}[by]


class Interner:
    """Label strings to small ids (0 is "")."""

    def __init__(self) -> None:
        self.names: list[str] = [""]
        self.ids: dict[str, int] = {"": 0}

    def __call__(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            self.names.append(name)
        return i


class LabelContext:
    """Shared inputs of the labelling passes, and the label arrays they write."""

    def __init__(self, raw: Events, strings: Sequence[str], tl: Timeline, plans: Sequence[Plan],
                 graphs: Sequence[CompiledGraph], main_thread: int | None, scopes: ScopeIndex) -> None:
        self.raw, self.strings, self.tl, self.scopes = raw, strings, tl, scopes
        self.plans = {p.index: p for p in plans}
        self.graphs = {g.key: g for g in graphs}
        self.main_thread = main_thread
        n = len(tl.rows)
        self.n = n
        self.names = Interner()
        self.scope_id = {name: i for i, name in enumerate(strings)}
        self.category = np.full(n, Category.UNATTRIBUTED, dtype=np.int8)
        self.node = np.zeros(n, dtype=np.int32)
        self.layer = np.zeros(n, dtype=np.int32)
        self.kernel = np.zeros(n, dtype=np.int32)
        self.thread = raw["thread"][tl.rows]
        # (the rows' own dtype: int32 below 2**31 events, `index_dtype`)
        self.free_row = np.where(tl.free_of >= 0, tl.rows[np.maximum(tl.free_of, 0)], len(raw))
        self.oom_rows = np.flatnonzero(raw["kind"] == Kind.OOM)
        # labels of a joined call by everything the join read of it (`join._call_shape`): category,
        # node, layer and kernel of each of its allocations, in order
        self.call_labels: dict[tuple[str, bool, int, bytes], tuple[np.ndarray, ...]] = {}

    def set(self, pos: np.ndarray | int, category: int, node: str = "", layer: str = "", kernel: str = "") -> None:
        self.category[pos] = category
        self.node[pos] = self.names(node)
        self.layer[pos] = self.names(layer)
        self.kernel[pos] = self.names(kernel)


def node_layer(plan: Plan | None, role: str, *names: str) -> str:
    """The layer of the first of `names` (an FX node and its fallbacks) whose module is known."""
    if plan is None:
        return ""
    graph = plan.backward if role == "backward" else plan.forward
    for name in names:
        node = graph.by_name.get(name) or plan.forward.by_name.get(name)
        if node is not None and node.module_path:
            return layer_of(node.module_path)
    return ""


def known_layer(name: str) -> str:
    """The layer of a known tensor ("layers.3.mlp.w.exp_avg" -> "layers.3"; unnamed ones: "")."""
    base = name.removesuffix(".grad").split(".exp_avg")[0].split(".step")[0]
    return "" if base.startswith("param_groups") else layer_of(base)


def small_unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(ids, return_inverse=True)` of small non-negative ids (string ids), by a table:
    linear, where a sort of millions of them was most of the eager labels' time and memory."""
    if not len(ids):
        return ids[:0], np.zeros(0, np.int32)
    present = np.flatnonzero(np.bincount(ids))
    table = np.zeros(int(present[-1]) + 1, np.int32)
    table[present] = np.arange(len(present), dtype=np.int32)
    return present, table[ids]
