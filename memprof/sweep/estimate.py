"""memprof's compile-time peak estimate: buffer lifetimes walked through Inductor's wrapper code.

Inductor's wrapper is the scheduled program: every buffer it allocates (`empty_strided_*`), every
extern call that returns a fresh tensor, every alias, reuse and `del`, in run order. This walks
the forward's and the backward's wrappers of one compiled pair the way they run in a training
step, with nothing from a training step measured:
- the forward starts from the step's resident memory (parameters, inputs: not counted) and ends
  holding its outputs; the user's outputs are dropped once the loss is computed, the saved
  activations stay;
- the backward starts holding the saved activations (shared storages counted once) and its
  tangents (AOTAutograd makes them contiguous: allocated), frees each input at its `del`
  (AOTAutograd steals the arguments), and ends holding the gradients it returns;
- sizes: allocations from their shape, stride and dtype; an extern op's fresh output from the FX
  node that Inductor names in the "Topologically Sorted Source Nodes" comment before it (a
  tuple's bytes summed); on CUDA each storage is rounded up to the caching allocator's 512-byte
  blocks;
- a fallback kernel's scratch (what it allocates above its outputs while it runs, e.g. the
  attention backward's workspace; the CPU's half-precision matmuls' float accumulators) is measured
  by running the kernel on placeholder inputs (`memprof.sweep.probe`); its call peaks that much
  above the live bytes.
The estimate is the pair's peak above the memory allocated when the step began (the sweep's
`step_peak`; `memprof.sweep.step_estimate` chains the pairs of a step). torch 2.11's own
`estimate_peak_memory` cancels graph outputs, i.e. every saved activation of a forward
(docs/sweep.md); this walk keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from memprof.analysis.sizes import static_bytes
from memprof.analysis.units import round_up
from memprof.analysis.wrapper_code import EXTERN_MATMULS, Line, lex
from memprof.plans import FxGraph, FxNode, Plan


@dataclass(frozen=True)
class GraphWalk:
    peak: int  # most bytes live (owned storages), the start included
    end: int  # bytes live after the return
    outputs: tuple[int | None, ...]  # storage id per returned value (None: not a tensor the graph owns)
    sizes: Mapping[int, int]  # storage id -> bytes
    unknown: tuple[str, ...]  # fresh outputs whose size had to be guessed
    # with explain=True: what is live at the peak, (what made it, bytes), largest first; the same by
    # the name that made each storage ("bufN", "input NAME", "scratch NODE"); the names returned
    at_peak: tuple[tuple[str, int], ...] = ()
    peak_makers: tuple[tuple[str, int], ...] = ()
    returned: frozenset[str] = frozenset()
    # the walk's requests in order for a model of the caching allocator: (key, bytes) allocates,
    # (key, 0) frees; `keys`: storage id -> the allocator keys it holds (a fallback op's tuple: one
    # per item, as the op allocates them)
    log: tuple[tuple[int, int], ...] = ()
    keys: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    # each Triton kernel launch and cuBLAS matrix multiply (`extern_kernels.mm`, ...), in order: (how
    # many of `log`'s requests came before it, kernel name)
    launches: tuple[tuple[int, str], ...] = ()


class _Walk:
    """The state of one wrapper walk: which storage each live name refers to, and the live bytes."""

    def __init__(self, graph: FxGraph | None, inputs: Mapping[str, tuple[int, int]], block: int, explain: bool,
                 scratch: Mapping[str, int] | None, key_base: int = 0,
                 input_keys: Mapping[int, tuple[int, ...]] | None = None) -> None:
        self.by_name = graph.by_name if graph is not None else {}
        self.by_source: dict[str, list[FxNode]] = {}  # the comment names Dynamo's nodes; FX nodes keep them as `source`
        for node in graph.nodes if graph is not None else ():
            if node.source:
                self.by_source.setdefault(node.source, []).append(node)
        self.inputs, self.block, self.explain, self.scratch = inputs, block, explain, scratch
        self.names: dict[str, int] = {}  # live name -> storage id
        self.refs: dict[int, int] = {}  # storage id -> names referring to it
        self.sizes: dict[int, int] = {}
        self.owned: set[int] = set()
        self.next_id = 1
        self.unknown: list[str] = []
        self.outputs: tuple[int | None, ...] = ()
        self.pending: tuple[str, ...] = ()
        # explain: storage id -> (the name that made it, what made it); every allocation and free in
        # order, and how many of them happened when the peak was reached (replayed at the end)
        self.made: dict[int, tuple[str, str]] = {}
        self.events: list[tuple[int, bool]] = []
        self.peak_at = 0
        self.peak_extra: tuple[str, str, int] | None = None  # (maker, description, bytes) of a scratch at the peak
        # a fallback op's tuple output: storage id -> each item's bytes, carved into a storage of
        # its own when the wrapper takes it out (`bufK = bufN[i]`); (tuple, item) -> that storage;
        # item storage -> (its tuple, the event that carved it)
        self.items: dict[int, list[int]] = {}
        self.carved: dict[tuple[int, int], int] = {}
        self.carved_from: dict[int, tuple[int, int]] = {}
        self.held_items: dict[int, list[int]] = {}  # tuple -> its carved items, which it holds until it goes
        for name, (sid, _size) in inputs.items():
            self.made.setdefault(sid, (f"input {name}", f"input {name}"))
        self.key_base = key_base
        self.keys: dict[int, list[int]] = {}  # storage id -> allocator keys (`GraphWalk.keys`)
        self.item_keys: dict[int, list[int | None]] = {}  # a tuple's keys by item (None: carved out)
        self.log: list[tuple[int, int]] = []
        self.launches: list[tuple[int, str]] = []
        self.live = 0
        for sid, nbytes in {v[0]: v[1] for v in inputs.values()}.items():
            self.keys[sid] = list((input_keys or {}).get(sid, (key_base + sid,)))
            self.sizes[sid] = nbytes
            self.owned.add(sid)
            self.refs[sid] = 0
            self.live += nbytes
        self.peak = self.live

    def bind(self, name: str, sid: int) -> None:
        if name in self.names:
            self.unbind(name)
        self.names[name] = sid
        self.refs[sid] = self.refs.get(sid, 0) + 1

    def unbind(self, name: str) -> None:
        sid = self.names.pop(name, None)
        if sid is not None:
            self._release(sid)

    def _release(self, sid: int) -> None:
        self.refs[sid] -= 1
        if self.refs[sid] == 0 and sid in self.owned:
            self.live -= self.sizes.get(sid, 0)
            self.owned.discard(sid)
            self.log.extend((k, 0) for k in self.keys.pop(sid, ()))
            if self.explain:
                self.events.append((sid, False))
            for item in self.held_items.pop(sid, ()):  # (a tuple's items go with it, once nothing else holds them)
                self._release(item)

    def new(self, name: str, nbytes: int, what: str, items: list[int] | None = None) -> None:
        sid = self.next_id
        self.next_id += 1
        self.sizes[sid] = round_up(nbytes, self.block)
        self.owned.add(sid)
        keys = [self._key() for _ in items] if items else [self.key_base + sid]
        self.keys[sid] = keys
        self.log.extend(zip(keys, items or [self.sizes[sid]], strict=True))
        if items:
            self.item_keys[sid] = list(keys)
        self.live += self.sizes[sid]
        if self.explain:
            self.made[sid] = (name, f"{name} ({what}; {', '.join(self.pending)})")
            self.events.append((sid, True))
            if self.live > self.peak:
                self.peak_at, self.peak_extra = len(self.events), None
        self.peak = max(self.peak, self.live)
        self.bind(name, sid)

    def fresh(self, ln: Line) -> None:
        """An extern op's fresh output: sized from the FX node the source comment names."""
        fx = self._node_of(ln)
        size = int(fx.bytes or 0) if fx is not None else 0
        if fx is None:
            self.unknown.append(f"{ln.name} = {ln.op}")
        items = [round_up(b, self.block) for b in fx.items] if fx is not None and len(fx.items) > 1 else []
        self.new(ln.name, sum(items) if items else size, ln.op, items)
        if items:
            self.items[self.names[ln.name]] = items
        self._scratch(ln, fx)

    def _node_of(self, ln: Line) -> FxNode | None:
        """The FX node an extern call runs: the last of the source comment's names whose target is the op."""
        for src in reversed(self.pending):
            candidates = [self.by_name[src]] if src in self.by_name else []
            candidates += self.by_source.get(src, [])
            match = [n for n in candidates if ln.op in n.target and n.bytes is not None]
            if match:
                return match[-1]
        return None

    def _scratch(self, ln: Line, fx: FxNode | None) -> None:
        """What the call allocates and frees while it runs (`scratch`), its outputs live."""
        extra = round_up(self.scratch.get(fx.name, 0), self.block) if self.scratch and fx is not None else 0
        if extra:
            key = self._key()
            self.log += [(key, extra), (key, 0)]
        if self.live + extra > self.peak:
            self.peak = self.live + extra
            if self.explain and fx is not None:
                self.peak_at = len(self.events)
                self.peak_extra = (f"scratch {fx.name}", f"scratch of {ln.op} ({fx.name})", extra)

    def carve(self, name: str, tuple_id: int, item: int) -> None:
        """`name = tuple[item]`: the item becomes a storage of its own (the bytes move out of the
        tuple's; nothing is allocated), freed when its last name and the tuple are gone (the tuple
        holds its items: `del bufK` before `del bufN` frees nothing)."""
        sizes = self.items[tuple_id]
        if (tuple_id, item) in self.carved:
            self.bind(name, self.carved[(tuple_id, item)])
            return
        if not 0 <= item < len(sizes) or tuple_id not in self.owned:
            self.bind(name, tuple_id)
            return
        sid = self.next_id
        self.next_id += 1
        self.sizes[sid] = sizes[item]
        self.sizes[tuple_id] -= sizes[item]
        self.owned.add(sid)
        self.carved[(tuple_id, item)] = sid
        item_keys = self.item_keys.get(tuple_id)
        if item_keys is not None and item_keys[item] is not None:
            self.keys[sid] = [int(item_keys[item] or 0)]
            item_keys[item] = None
            self.keys[tuple_id] = [k for k in item_keys if k is not None]
        if self.explain:
            self.made[sid] = (name, f"{name} (item {item} of {self.made.get(tuple_id, ('?', '?'))[1]})")
            self.events.append((sid, True))
            self.carved_from[sid] = (tuple_id, len(self.events))
        self.bind(name, sid)
        self.refs[sid] += 1  # the tuple's
        self.held_items.setdefault(tuple_id, []).append(sid)

    def _key(self) -> int:
        """A fresh allocator key (an id no storage of this walk uses)."""
        self.next_id += 1
        return self.key_base + self.next_id - 1

    def line(self, ln: Line) -> None:
        k = ln.kind
        if k == "source":
            self.pending = ln.names
        elif k == "args":
            for name in ln.names:
                if name in self.inputs:
                    self.bind(name, self.inputs[name][0])
        elif k == "alloc" and ln.alloc is not None:  # empty_strided_<device> or torch.empty_strided
            a = ln.alloc
            self.new(a.name, static_bytes(a.shape, a.stride, a.dtype) or 0, "empty_strided")
        elif k == "copy" and ln.item >= 0 and self.names.get(ln.target) in self.items:
            self.carve(ln.name, self.names[ln.target], ln.item)
        elif k in ("alias", "copy"):
            if ln.target in self.names:
                self.bind(ln.name, self.names[ln.target])
        elif k == "extern":
            self.fresh(ln)
            if ln.op in EXTERN_MATMULS:
                self.launches.append((len(self.log), f"extern_kernels.{ln.op}"))
        elif k == "triton" or (k == "extern_out" and ln.op in EXTERN_MATMULS):
            self.launches.append((len(self.log), ln.op if k == "triton" else f"extern_kernels.{ln.op}"))
            if k == "extern_out" and self.scratch:  # (the CPU's half-precision ones: `torch_hooks.fx.probed`)
                self._scratch(ln, self._node_of(ln))
        elif k == "return":
            self.outputs = tuple(self.names.get(r) if r is not None else None for r in ln.returns)
        for name in ln.dels:
            self.unbind(name)

    def result(self) -> GraphWalk:
        keys = {sid: tuple(k) for sid, k in self.keys.items()}
        if not self.explain:
            return GraphWalk(self.peak, self.live, self.outputs, self.sizes, tuple(self.unknown),
                             log=tuple(self.log), keys=keys, launches=tuple(self.launches))
        at_peak = {s for s in self.sizes if s < 0}  # the inputs, live at the start
        for sid, alive in self.events[:self.peak_at]:
            if alive:
                at_peak.add(sid)
            else:
                at_peak.discard(sid)
        size = dict(self.sizes)
        for sid, (tuple_id, at) in self.carved_from.items():
            if at > self.peak_at:  # carved after the peak: its bytes were still the tuple's there
                size[tuple_id] += size[sid]
        rows = [(*self.made.get(s, ("?", "?")), size[s]) for s in at_peak]
        if self.peak_extra is not None:
            rows.append(self.peak_extra)
        rows.sort(key=lambda r: -r[2])
        returned = frozenset(self.made[s][0] for s in self.outputs if s is not None and s in self.made)
        return GraphWalk(self.peak, self.live, self.outputs, self.sizes, tuple(self.unknown),
                         tuple((r[1], r[2]) for r in rows), tuple((r[0], r[2]) for r in rows), returned,
                         tuple(self.log), keys, tuple(self.launches))


def walk_wrapper(source: str, graph: FxGraph | None, inputs: Mapping[str, tuple[int, int]] | None = None,
                 block: int = 1, explain: bool = False, scratch: Mapping[str, int] | None = None,
                 held: frozenset[str] = frozenset(), key_base: int = 0,
                 input_keys: Mapping[int, tuple[int, ...]] | None = None) -> GraphWalk:
    """Walk one wrapper's `call`. `inputs`: for inputs the graph owns (freed at their `del`), name ->
    (storage id, bytes); others are resident and cost nothing. Storage ids of inputs must be < 0.
    `explain`: also say what is live at the peak (each storage by the line that made it).
    `scratch`: FX node name -> bytes a fallback kernel allocates above its outputs while it runs
    (`memprof.sweep.probe`); its call peaks that much above the live bytes with its outputs.
    `held`: inputs counted live to the end whatever the wrapper deletes (someone else holds them).
    `key_base`, `input_keys`: the allocator keys of this walk's storages start at `key_base`; an
    owned input's keys (default `key_base` + its id) name the storage an earlier walk made."""
    walk = _Walk(graph, inputs or {}, block, explain, scratch, key_base, input_keys)
    for name in held:
        if name in walk.inputs:
            sid = walk.inputs[name][0]
            walk.refs[sid] = walk.refs.get(sid, 0) + 1
    for ln in lex(source):
        walk.line(ln)
    return walk.result()


@dataclass(frozen=True)
class StepEstimate:
    peak: int  # the step's peak above its start
    fw_peak: int
    bw_peak: int
    saved: int  # bytes of saved activations held between forward and backward
    unknown: tuple[str, ...]
    phase: str  # where the peak is: "forward" or "backward"
    walk: GraphWalk  # the walk of that graph (with explain=True, what is live at the peak)
    fw: GraphWalk | None = None
    bw: GraphWalk | None = None
    # the backward's owned inputs, name -> (storage id, bytes), and their allocator keys by storage id
    bw_inputs: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    bw_input_keys: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    held_tangents: frozenset[str] = frozenset()  # tangents live to the backward's end (`kept_tangents`)

    @property
    def at_peak(self) -> tuple[tuple[str, int], ...]:
        return self.walk.at_peak


BW_KEYS = 10 ** 14  # a backward's allocator keys start this far above its forward's (`estimate_step`)
# storage ids of a backward's inputs that no forward storage is (tangents, earlier graphs' activations)
# count down from here; above it, input -sid is the forward's storage sid
_OTHER_INPUTS = -(10 ** 9)


def _backward_inputs(plan: Plan, fw: GraphWalk, block: int, activations: Mapping[str, int]
                     ) -> dict[str, tuple[int, int]]:
    """The backward's owned inputs: the saved activations (the forward's storages, shared ones once;
    and saved graph inputs that are activations of an earlier graph, `activations`) and its
    tangents (allocated contiguous by AOTAutograd)."""
    saved_ids = fw.outputs[plan.num_fwd_outputs:]
    inputs: dict[str, tuple[int, int]] = {}
    for name, sid in zip(plan.saved, saved_ids, strict=False):
        if sid is not None:
            inputs[name] = (-sid, fw.sizes[sid])
    other_id = _OTHER_INPUTS
    for name in plan.saved:
        if name in activations and name not in inputs:
            inputs[name] = (other_id, round_up(activations[name], block))
            other_id -= 1
    for node in tangent_nodes(plan):
        inputs[node.name] = (other_id, round_up(int(node.bytes or 0), block))
        other_id -= 1
    return inputs


def tangent_nodes(plan: Plan) -> list[FxNode]:
    """The backward's tangent placeholders that hold memory, in order."""
    return [n for n in plan.backward.nodes if n.op == "placeholder" and n.name.startswith("tangents") and n.bytes]


def estimate_step(plan: Plan, fw_source: str, bw_source: str | None, block: int = 1,
                  explain: bool = False, scratch: tuple[Mapping[str, int], Mapping[str, int]] | None = None,
                  activations: Mapping[str, int] | None = None, held_tangents: frozenset[str] = frozenset(),
                  key_base: int = 0, input_keys: Mapping[str, tuple[int, ...]] | None = None) -> StepEstimate:
    """The step peak of one forward/backward pair from its wrapper code and plan. `scratch`: the
    forward's and the backward's fallback kernels' scratch bytes by FX node name. `activations`:
    the pair's inputs that an earlier graph of the step computed (placeholder name -> bytes; see
    `activation_inputs`): not resident, live while the forward runs, and held into the backward
    when saved (the rest are parameters and user inputs, resident). `held_tangents`: the tangents
    that stay live to the backward's end (`kept_tangents`). `key_base`: where the walks' allocator keys
    start (the forward's; the backward's `BW_KEYS` above); `input_keys`: the keys of backward inputs
    an earlier walk made, by name (an earlier graph's activations; a tangent that is a gradient
    another backward returned); the rest of its tangents get keys of their own."""
    fw_scratch, bw_scratch = scratch or ({}, {})
    acts = dict(activations or {})
    fw = walk_wrapper(fw_source, plan.forward, None, block, explain, fw_scratch, key_base=key_base)
    fw_peak = fw.peak + sum(round_up(b, block) for b in acts.values())
    # the user's outputs (fw.outputs[:num_fwd_outputs]) are gone before the backward starts (the
    # loss consumed them); the saved activations stay
    kept = {s for s in fw.outputs[plan.num_fwd_outputs:] if s is not None}
    held = sum(fw.sizes[s] for s in kept) + sum(round_up(b, block) for n, b in acts.items() if n in plan.saved)
    if bw_source is None:
        return StepEstimate(fw_peak, fw_peak, 0, held, fw.unknown, "forward", fw, fw)
    inputs = _backward_inputs(plan, fw, block, acts)
    given = input_keys or {}
    keys = {sid: fw.keys.get(-sid, ()) if sid > _OTHER_INPUTS else given.get(name, (key_base + BW_KEYS + sid,))
            for name, (sid, _b) in inputs.items()}
    bw = walk_wrapper(bw_source, plan.backward, inputs, block, explain, bw_scratch,
                      held=held_tangents, key_base=key_base + BW_KEYS,
                      input_keys=keys)
    peak, phase = (bw.peak, "backward") if bw.peak >= fw_peak else (fw_peak, "forward")
    return StepEstimate(peak, fw_peak, bw.peak, held, fw.unknown + bw.unknown, phase, bw if phase == "backward" else fw,
                        fw, bw, inputs, keys, held_tangents)
