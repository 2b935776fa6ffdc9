"""A model of PyTorch's CUDA caching allocator at its default settings: which block each request
gets, and so the bytes `torch.cuda.max_memory_allocated()` and `max_memory_reserved()` count.

The allocator counts a block's size, not the request's: a request is rounded up to 512 bytes, and a
free block is split only when what would remain is at least 512 bytes (requests of 1 MiB or less,
packed in 2 MiB segments) or more than 1 MiB (larger ones). So a 2 MiB request that finds a free
3 MiB block takes all of it: an estimate that adds up rounded requests is short by whatever such
blocks hold over. Which free block a request finds depends on every earlier request and free, so
the model replays them: the smallest free block of the request's pool and stream that is large
enough (the lowest address among equal sizes), split from its front; a new segment (2 MiB for small
requests, 20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB) where none is; a
freed block merged with free neighbours of its segment. Segments are never returned (no
`empty_cache`, no retry after a failed cudaMalloc), and no requests but those it is given: a
compiled graph's first call also allocates what Triton's autotuning benchmarks (Inductor flushes
the L2 cache with a buffer of its size before each timing), which can leave segments a prediction
does not make (docs/fit.md). The allocator's options
(`PYTORCH_CUDA_ALLOC_CONF`: max_split_size_mb, roundup_power2_divisions, expandable_segments) are not
modelled: `settings_modelled` says whether a configuration string is one the model holds for.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from memprof._events import FLAG_CARRIED, Events, Kind
from memprof.analysis.timeline import Timeline

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to 1 MiB use the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment for a request between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here a segment is the request rounded up
ROUND_LARGE = 2 << 20  # kRoundLarge: large segments are multiples of 2 MiB
# allocator events `model_at` replays at most: about 1.5 µs each in Python, so a report of a long
# capture spends at most a second or two on it (beyond, the estimate counts requests)
REPLAY_EVENTS = 1_000_000
_BETWEEN_KEYS = -(1 << 62)  # `steady_peak`'s keys for what is allocated between two steps count down from here


def round_size(nbytes: int) -> int:
    """The block size a request asks for (`round_size` at the default settings)."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The cudaMalloc a rounded request makes when no free block fits (`get_allocation_size`)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def settings_modelled(alloc_conf: str) -> bool:
    """Whether the model holds for a `PYTORCH_CUDA_ALLOC_CONF` value: the defaults, or options that
    do not change which block a request gets."""
    harmless = {"garbage_collection_threshold", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                "pinned_num_register_threads", "backend"}
    for part in filter(None, (p.strip() for p in alloc_conf.split(","))):
        key, _, value = part.partition(":")
        key, value = key.strip(), value.strip().lower()
        if key == "expandable_segments" and value in ("false", "0"):
            continue
        if key == "backend" and value not in ("native", ""):
            return False
        if key not in harmless:
            return False
    return True


@dataclass(eq=False)
class _Block:
    ptr: int
    size: int
    stream: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class CachingAllocatorModel:
    """The allocator's state for one device: blocks, free lists and counters. `malloc(key, nbytes)`
    returns the size of the block the request gets; `free(key)` gives it back. `new_segment(size)`
    says where a new segment starts (a replay of a capture passes the recorded addresses; the
    default lays segments out one after another, which decides only ties between equal free blocks)."""

    new_segment: Callable[[int], int] | None = None
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    segments: int = 0
    _blocks: dict[int, _Block] = field(default_factory=dict)  # key -> allocated block
    _free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    _free_at: dict[tuple[bool, int], _Block] = field(default_factory=dict)  # (pool, ptr) -> free block
    _next_address: int = 1 << 40

    def malloc(self, key: int, nbytes: int, stream: int = 0) -> int:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(small, stream, size)
        if block is None:
            block = self._segment(small, stream, segment_size(size))
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.ptr + size, remaining, stream, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert_free(rest)
        block.allocated = True
        self._blocks[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.size

    def free(self, key: int) -> int:
        """Free the block `key` got; returns its size (0 for a key never allocated)."""
        block = self._blocks.pop(key, None)
        if block is None:
            return 0
        size = block.size
        self.allocated -= size
        block.allocated = False
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    block.ptr, block.prev = neighbour.ptr, neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._insert_free(block)
        return size

    def block_of(self, key: int) -> int:
        """The size of the block `key` holds (0 if none)."""
        block = self._blocks.get(key)
        return block.size if block is not None else 0

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def copy(self) -> CachingAllocatorModel:
        """An independent copy (to replay different requests from the same state)."""
        new = {id(b): dataclasses.replace(b) for b in (*self._blocks.values(), *self._free_at.values())}
        for b in new.values():
            b.prev = new[id(b.prev)] if b.prev is not None else None
            b.next = new[id(b.next)] if b.next is not None else None
        out = dataclasses.replace(self, _blocks={k: new[id(b)] for k, b in self._blocks.items()},
                                  _free={pool: list(blocks) for pool, blocks in self._free.items()},
                                  _free_at={k: new[id(b)] for k, b in self._free_at.items()})
        return out

    def run(self, requests: Iterable[tuple[int, int]], stream: int = 0) -> int:
        """Replay (key, bytes) requests, (key, 0) freeing; returns the most bytes allocated above the
        start while they ran."""
        start = self.allocated
        self.reset_peaks()
        for key, nbytes in requests:
            if nbytes > 0:
                self.malloc(key, nbytes, stream)
            else:
                self.free(key)
        return self.peak_allocated - start

    def _segment(self, small: bool, stream: int, size: int) -> _Block:
        if self.new_segment is not None:
            ptr = self.new_segment(size)
        else:
            ptr, self._next_address = self._next_address, self._next_address + size + ROUND_LARGE
        self.reserved += size
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(ptr, size, stream, small)

    def _take_free(self, small: bool, stream: int, size: int) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (stream, size, -1))
        if i == len(pool) or pool[i][0] != stream:
            return None
        _s, _size, ptr = pool.pop(i)
        return self._free_at.pop((small, ptr))

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.stream, block.size, block.ptr))
        self._free_at[(block.small, block.ptr)] = block

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.stream, block.size, block.ptr))
        del pool[i]
        del self._free_at[(block.small, block.ptr)]


def model_at(raw: Events, timeline: Timeline, pos: int, alloc_conf: str = "",
             limit: int = REPLAY_EVENTS) -> CachingAllocatorModel | None:
    """The allocator of `timeline`'s device as it was just after timeline position `pos`, replayed
    from the capture's requests with its segments where the capture saw them; None where the capture
    cannot give it exactly: not a CUDA device, allocator settings the model does not hold for
    (`alloc_conf`: the capture's PYTORCH_CUDA_ALLOC_CONF), a capture that began mid-run (blocks or
    segments from before it), requests not recorded, a replay that disagrees with a recorded
    block or segment, or more than `limit` events to replay."""
    if not timeline.device.startswith("cuda") or timeline.baseline or timeline.reserved_baseline or pos + 1 > limit:
        return None
    if not settings_modelled(alloc_conf):
        return None
    upto = timeline.rows[: pos + 1]
    if len(upto) and (np.any(raw["flags"][upto] & FLAG_CARRIED) or np.any(raw["kind"][upto] > Kind.FREE)):
        return None
    end_row = int(upto[-1]) + 1 if len(upto) else 0
    seg_rows = timeline.reserved_rows[timeline.reserved_rows < end_row]
    seg_rows = seg_rows[raw["kind"][seg_rows] == Kind.SEGMENT_ALLOC]
    segments = iter(zip(raw["bytes"][seg_rows].tolist(), raw["ptr"][seg_rows].tolist(), strict=True))
    wrong: list[int] = []

    def recorded_segment(size: int) -> int:
        nbytes, ptr = next(segments, (-1, 0))
        if nbytes != size:
            wrong.append(size)
        return int(ptr)

    model = CachingAllocatorModel(new_segment=recorded_segment)
    sub = raw[upto]
    for kind, nbytes, ptr, stream, requested in zip(sub["kind"].tolist(), sub["bytes"].tolist(), sub["ptr"].tolist(),
                                                    sub["stream"].tolist(), sub["aux"].tolist(), strict=True):
        if kind == Kind.ALLOC:
            if requested < 0 or model.malloc(ptr, requested, stream) != nbytes:
                return None
        else:
            model.free(ptr)
        if wrong:
            return None
    model.new_segment = None  # later segments: laid out past the recorded ones
    ends = raw["ptr"][seg_rows] + raw["bytes"][seg_rows].astype(np.uint64)
    model._next_address = max(model._next_address, int(ends.max()) + ROUND_LARGE if len(ends) else 0)
    model.reset_peaks()
    return model


def model_from_segments(segments: Sequence[Mapping[str, Any]], device: int) -> CachingAllocatorModel:
    """The allocator as a memory snapshot shows it (`torch.cuda.memory._snapshot()["segments"]`: each
    segment's address, size, stream, pool and blocks in address order, each active or not). Blocks
    in use get keys below zero (they are never freed by a replay); a block pending free counts as
    in use, as it does for the allocator until its stream's work is done."""
    model = CachingAllocatorModel()
    key = -1
    for seg in segments:
        if int(seg.get("device", device)) != device:
            continue
        small = seg.get("segment_type") == "small"
        stream = int(seg.get("stream", 0) or 0)
        ptr = int(seg["address"])
        model.reserved += int(seg["total_size"])
        model.segments += 1
        prev: _Block | None = None
        for b in seg.get("blocks", []) or []:
            block = _Block(ptr, int(b["size"]), stream, small, allocated=b.get("state") != "inactive", prev=prev)
            if prev is not None:
                prev.next = block
            if block.allocated:
                model._blocks[key] = block
                model.allocated += block.size
                key -= 1
            else:
                model._insert_free(block)
            ptr += block.size
            prev = block
        model._next_address = max(model._next_address, ptr + ROUND_LARGE)
    model.reset_peaks()
    return model


class OptimizerStep(NamedTuple):
    """What the optimizers' first step allocates: their state, kept (`state`, in order), and the
    temporaries the step makes and frees again before it ends (`transient`: (key, bytes) requests,
    (key, 0) freeing, keys from 0), while the gradients are still live (foreach Adam's
    `_foreach_sqrt` of every `exp_avg_sq`, say)."""

    state: Sequence[int]
    transient: Sequence[tuple[int, int]] = ()
    grads: int = 0  # the bytes of its parameters' gradients, live while it runs (after the backward)


def optimizer_peak(between: OptimizerStep) -> int:
    """The most an optimizer step holds above the parameters and its state, in requested bytes: the
    gradients, and its temporaries at their most."""
    live, peak = 0, 0
    sizes: dict[int, int] = {}
    for key, nbytes in between.transient:
        live += nbytes if nbytes else -sizes.pop(key, 0)
        if nbytes:
            sizes[key] = nbytes
        peak = max(peak, live)
    return between.grads + peak


@dataclass(frozen=True)
class SteadyStep:
    """A step after the first as the model runs it: the bytes allocated when it starts (what was
    there before the first step, and what the first left: the optimizer's state in the blocks it
    got), the most it allocates above that (its optimizer step's temporaries beside the gradients
    included), and the bytes reserved when it ends (the model returns no
    segment: its reserved peak)."""

    start: int
    peak: int
    reserved: int


def steady_peak(model: CachingAllocatorModel, step: Sequence[Sequence[tuple[int, int]]],
                between: OptimizerStep, first: Sequence[Sequence[tuple[int, int]]] | None = None,
                keep: frozenset[int] = frozenset()) -> SteadyStep:
    """The step after the first, each step running the request lists of `step` in order from
    `model` (not changed): after the first, the optimizer's step runs (its state allocated and
    kept, its temporaries allocated and freed) and everything the step left is freed (the
    gradients, by `zero_grad`). `first`: the first step's lists where they differ (its graphs'
    first calls autotune), whose keys in `keep` stay allocated (cuBLAS's workspaces)."""
    m = model.copy()
    resident = set(m._blocks)
    for requests in step if first is None else first:
        m.run(requests)
    kept = {_BETWEEN_KEYS - k for k in range(len(between.state))}  # below the snapshot's keys (-1, -2, ...)
    for key, nbytes in zip(sorted(kept, reverse=True), between.state, strict=True):
        m.malloc(key, nbytes)
    # (their keys below the state's)
    m.run((_BETWEEN_KEYS - len(between.state) - key, nbytes) for key, nbytes in between.transient)
    for k in [k for k in m._blocks if k not in resident and k not in kept and k not in keep]:
        m.free(k)
    start, peak = m.allocated, 0
    for requests in step:
        m.run(requests)
        peak = max(peak, m.peak_allocated - start)
    # its optimizer step, the gradients still live: the state is there, the temporaries come and go
    m.run((_BETWEEN_KEYS - len(between.state) - key, nbytes) for key, nbytes in between.transient)
    peak = max(peak, m.peak_allocated - start)
    return SteadyStep(start, peak, m.reserved)
