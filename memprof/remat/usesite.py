"""Use-site rematerialization of a backward graph (pure decision code; no torch).

XLA-style: a value computed early and held across the peak for a late use is computed again
just before that use, from inputs that are live there anyway, so the first copy dies early.
One edit clones a small cone (at most `max_cone` nodes) before the first late user and points
the late users at the clone. An edit is kept only when the estimated peak falls by more than
the estimate's error (see `rematerialize`); random ops, non-functional ops and anything
`clonable=False` are never cloned, and in mode "light" neither are matrix multiplies.
Attention is never cloned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memprof.remat.graph import ATTENTION, HEAVY, INPUT, ITEM, OTHER, POINTWISE, RANDOM, REDUCTION, VIEW, Node, walk

MODES = ("light", "all")
_LIGHT = (POINTWISE, VIEW, REDUCTION, ITEM)


@dataclass
class Edit:
    target: int  # the value whose late uses move to the clone
    cone: list[int]  # nodes cloned, in program order (target last)
    before: int  # the node the clones run just before
    users: list[int]  # late users redirected to the clone
    clones: list[int] = field(default_factory=list)  # ids of the clones (appended to the node list)


@dataclass
class Program:
    """A backward graph: nodes (placeholders are `start`), an execution order, outputs kept to the end."""

    nodes: list[Node]
    order: list[int]
    start: list[int]
    keep: list[int]


@dataclass
class UseSiteResult:
    edits: list[Edit]
    peak_before: int
    peak_after: int
    trace: list[int]  # estimated peak after each accepted edit (non-increasing)
    added_cost: float
    tried: int
    seconds: float
    stopped: str  # why the search ended


def clonable(node: Node, mode: str) -> bool:
    if not node.clonable or node.kind in (RANDOM, ATTENTION, INPUT, OTHER) or node.resident:
        return False
    if node.kind == HEAVY:
        return mode == "all"
    return node.kind in _LIGHT


def _users(prog: Program) -> dict[int, list[int]]:
    users: dict[int, list[int]] = {}
    for j in prog.order:
        for k in prog.nodes[j].inputs:
            users.setdefault(k, []).append(j)
    return users


def _dce(prog: Program) -> None:
    keep = set(prog.keep)
    while True:
        users = _users(prog)
        dead = {j for j in prog.order if j not in users and j not in keep and prog.nodes[j].clonable}
        if not dead:
            return
        prog.order = [j for j in prog.order if j not in dead]


def _root(nodes: list[Node], j: int) -> int:
    while nodes[j].alias >= 0:
        j = nodes[j].alias
    return j


def _plan_edit(prog: Program, t: int, pos: dict[int, int], users: dict[int, list[int]], last: dict[int, int],
               peak_at: int, mode: str, max_cone: int) -> Edit | None:
    nodes = prog.nodes
    late = sorted({u for u in users.get(t, ()) if pos[u] > peak_at}, key=pos.__getitem__)
    if not late or not clonable(nodes[t], mode):
        return None
    ins = pos[late[0]]
    start = set(prog.start)
    cone: set[int] = set()
    stack = [t]
    while stack:
        c = stack.pop()
        if c in cone:
            continue
        cone.add(c)
        if len(cone) > max_cone:
            return None
        for k in nodes[c].inputs:
            if k in cone or k in start or nodes[k].resident:
                continue
            r = _root(nodes, k)
            if r != _root(nodes, t) and last.get(r, -1) >= ins:
                continue  # live at the use site anyway: reuse it
            if not clonable(nodes[k], mode):
                if pos.get(k, ins) < ins and last.get(r, -1) >= pos.get(k, 0):
                    continue  # cannot clone: reuse it (its lifetime grows; the estimate judges)
                return None
            stack.append(k)
    if any(nodes[c].kind == ITEM and nodes[c].inputs[0] not in cone for c in cone):
        return None  # a getitem alone would share its op's storage: nothing to move
    order = sorted(cone, key=pos.__getitem__)
    return Edit(t, order, late[0], late)


def _apply(prog: Program, e: Edit) -> list[tuple[int, tuple[int, ...], int]]:
    """Apply an edit in place; returns what `_undo` needs."""
    env: dict[int, int] = {}
    for c in e.cone:
        src = prog.nodes[c]
        nid = len(prog.nodes)
        prog.nodes.append(Node(f"{src.name}_r{nid}", src.kind, tuple(env.get(k, k) for k in src.inputs), src.nbytes,
                               env.get(src.alias, src.alias), src.cost, src.clonable, False, src.layer))
        env[c] = nid
    e.clones = [env[c] for c in e.cone]
    i = prog.order.index(e.before)
    prog.order[i:i] = e.clones
    old: list[tuple[int, tuple[int, ...], int]] = []
    clone_t = env[e.target]
    for u in e.users:
        nd = prog.nodes[u]
        old.append((u, nd.inputs, nd.alias))
        nd.inputs = tuple(clone_t if k == e.target else k for k in nd.inputs)
        if nd.alias == e.target:  # a view of the target now views the clone
            nd.alias = clone_t
    return old


def _undo(prog: Program, e: Edit, old: list[tuple[int, tuple[int, ...], int]]) -> None:
    for u, ins, alias in reversed(old):
        prog.nodes[u].inputs = ins
        prog.nodes[u].alias = alias
    clones = set(e.clones)
    prog.order = [j for j in prog.order if j not in clones]
    del prog.nodes[min(e.clones):]
    e.clones = []


def rematerialize(prog: Program, mode: str, max_cone: int = 12, max_edits: int = 1000, patience: int = 60,
                  time_limit: float = 3.0, fuse: bool = True, min_gain: float = 0.01,
                  clone_factor: float = 0.5) -> UseSiteResult:
    """Greedy use-site rematerialization of `prog` (edited in place).

    An edit is kept only if the estimated peak falls by more than the estimate's error can
    explain: by at least `min_gain` of the peak and by at least `clone_factor` times the bytes
    the clones allocate (on Inductor, smaller estimated gains did not survive its fusion and
    reordering; docs/benchmarks.md, "Figures behind design choices").
    """
    if mode not in MODES:
        raise ValueError(f"unknown remat mode {mode!r} (expected one of {', '.join(MODES)})")
    t0 = time.perf_counter()
    cur = walk(prog.nodes, prog.order, prog.start, prog.keep, fuse=fuse)
    before = cur.peak
    trace = [cur.peak]
    edits: list[Edit] = []
    tried_bad: set[int] = set()
    fails = tried = 0
    added = 0.0
    stopped = "no edit lowers the estimate"
    while len(edits) < max_edits:
        pos = {j: p for p, j in enumerate(prog.order)}
        users = _users(prog)
        nodes = prog.nodes
        live = set(cur.live_at_peak)
        cands = [t for t in prog.order
                 if t not in tried_bad and pos[t] <= cur.peak_at and _root(nodes, t) in live
                 and any(pos[u] > cur.peak_at for u in users.get(t, ()))]
        cands.sort(key=lambda t: -nodes[_root(nodes, t)].nbytes)
        progress = False
        for t in cands:
            if time.perf_counter() - t0 > time_limit:
                stopped = f"time limit ({time_limit:.1f} s)"
                break
            edit = _plan_edit(prog, t, pos, users, cur.last_use, cur.peak_at, mode, max_cone)
            if edit is None:
                tried_bad.add(t)
                continue
            tried += 1
            old = _apply(prog, edit)
            new = walk(prog.nodes, prog.order, prog.start, prog.keep, fuse=fuse)
            cloned = sum(prog.nodes[c].nbytes for c in edit.clones if prog.nodes[c].alias < 0)
            ok = cur.peak - new.peak >= max(min_gain * cur.peak, clone_factor * cloned, 1)
            if ok:
                edits.append(edit)
                added += sum(prog.nodes[c].cost for c in edit.cone)
                _dce(prog)
                cur = walk(prog.nodes, prog.order, prog.start, prog.keep, fuse=fuse)
                trace.append(cur.peak)
                progress = True
                break
            _undo(prog, edit, old)
            tried_bad.add(t)
            fails += 1
            if fails > patience:
                stopped = f"{patience} rejected edits in a row"
                break
        if not progress:
            break
        fails = 0
    else:
        stopped = f"edit limit ({max_edits})"
    return UseSiteResult(edits, before, cur.peak, trace, added, tried, time.perf_counter() - t0, stopped)
