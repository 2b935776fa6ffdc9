"""A capture's metadata (`Capture.meta`, stored as meta.json): its declared schema (`META`), which
the writer, the loader's check and `CaptureInfo` all read, and `CaptureInfo`, what the analysis reads
of it, typed."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from memprof.errors import MemprofError

# |bytes| of one block or event; larger is not real memory (and sums of such would overflow int64)
MAX_BLOCK_BYTES = 1 << 50
MAX_TOTAL_BYTES = 1 << 62
MAX_TIME_NS = 1 << 62  # steady-clock nanoseconds: 146 years
MAX_WORLD_SIZE = 1 << 20
_DEVICE = re.compile(r"^(cpu|cuda:\d{1,3})$")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return _is_int(v) and 0 <= v < 1 << 63


def _int64(v: Any) -> bool:
    return _is_int(v) and -(1 << 63) <= v < 1 << 63


def _time(v: Any) -> bool:
    return _is_int(v) and 0 <= v < MAX_TIME_NS


def _block(v: Any) -> bool:
    return _is_int(v) and 0 <= v <= MAX_BLOCK_BYTES


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _number(v: Any) -> bool:  # (NaN and infinities are numbers here: reports print them as null and say so)
    return isinstance(v, int | float) and not isinstance(v, bool) and (not _is_int(v) or _int64(v))


def _per_device(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(d, str) and _DEVICE.match(d) and ok(x)
                                                 for d, x in v.items())


def _baseline(v: Any) -> bool:
    return (isinstance(v, dict) and set(v) <= {"allocated", "reserved"}
            and all(_is_int(x) and 0 <= x <= MAX_TOTAL_BYTES for x in v.values()))


def _blocks(v: Any) -> bool:
    return (isinstance(v, list) and all(isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and 0 <= b[0] < 1 << 64
                                        and _block(b[1]) for b in v)
            and sum(b[1] for b in v) <= MAX_TOTAL_BYTES)


def _window(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_count(x) for x in v) and 1 <= v[0] <= v[1]


def _probes(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(p, list) and len(p) == 2 and (p[0] is None or _block(p[0]))
        and isinstance(p[1], str) for k, p in v.items())


def _tangents(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and k.isdigit() and len(k) < 10 and _strings(names)
                                       for k, names in v.items())


def _distributed(v: Any) -> bool:
    if not isinstance(v, dict):
        return False
    world, rank = v.get("world_size"), v.get("rank")
    if not isinstance(world, int) or not isinstance(rank, int) or not (_is_int(world) and _is_int(rank)):
        return False
    return (1 <= world <= MAX_WORLD_SIZE and 0 <= rank < world
            and all(v.get(k) is None or _count(v.get(k)) for k in ("local_rank", "node"))
            and all(v.get(k) is None or _str(v.get(k)) for k in ("run_id", "backend")))


class MetaField(NamedTuple):
    what: str  # what the value must be, for the error line
    ok: Callable[[Any], bool]


# Every meta.json field memprof reads, and what it must be (absent or null is always allowed; fields
# not named here are kept as they are, for later memprofs' files).
META: dict[str, MetaField] = {
    **dict.fromkeys(("t_start_ns", "t_stop_ns", "first_dropped_ns"), MetaField("a time in nanoseconds", _time)),
    **dict.fromkeys(("dropped_events", "max_events", "steps", "dataloader_workers", "child_processes", "keep_last",
                     "pid", "native_tid"), MetaField("a whole number", _count)),
    **dict.fromkeys(("exit_code", "main_thread"), MetaField("an integer", _int64)),
    "budget": MetaField("a number", _number),
    "first_in_process": MetaField("true or false", lambda v: isinstance(v, bool)),
    **dict.fromkeys(("notes", "recompile_limits", "graph_breaks", "argv", "options_after_script"),
                    MetaField("a list of strings", _strings)),
    "baselines": MetaField("{device: {allocated, reserved}} in bytes", _per_device(_baseline)),
    "device_total": MetaField("{device: bytes}", _per_device(lambda x: _is_int(x) and 0 <= x <= MAX_TOTAL_BYTES)),
    "preexisting": MetaField("{device: [[ptr, bytes], ...]}", _per_device(_blocks)),
    "window": MetaField("a step window [A, B] with 1 <= A <= B", _window),
    "distributed": MetaField("{rank, world_size, local_rank, node, run_id, backend}", _distributed),
    "scratch_probes": MetaField("{call: [bytes or null, why]}", _probes),
    "tangents_kept": MetaField("{plan index: [tangent names]}", _tangents),
    **dict.fromkeys((
        "command", "status", "error", "stopped_by", "cuda_tracker", "cpu_threads", "step_source", "scopes",
        "memprof_version", "torch_version", "cuda_version", "python_version", "plans", "remat", "script",
        "allocator_backend", "cpu_note", "alloc_conf", "recovered_from", "window_state", "ended_by", "path",
        "hostname", "platform", "created"), MetaField("a string", _str)),
}


def meta_problem(meta: dict[str, Any]) -> str | None:
    """The first field of `meta` that is not what `META` declares, as "KEY is not WHAT" (None: all are)."""
    for key, spec in META.items():
        value = meta.get(key)
        if value is not None and not spec.ok(value):
            return f"{key} is not {spec.what}"
    return None


def conform(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` as memprof writes it: a field that is not what `META` declares (a script can set odd
    values, a budget of NaN is kept) is left out, and a note says so; memprof never writes a file
    it would refuse to read."""
    out = dict(meta)
    dropped = [(key, spec.what) for key, spec in META.items() if out.get(key) is not None and not spec.ok(out[key])]
    for key, _what in dropped:
        del out[key]
    if dropped:
        notes = out.get("notes")
        out["notes"] = [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else []
        out["notes"] += [f"meta field {key} was not {what}: left out of the file" for key, what in dropped]
    return out


def _get(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """The value of a declared field, or `default` where it is absent or not what `META` declares."""
    value = meta.get(key)
    return value if value is not None and META[key].ok(value) else default


def budget_problem(budget: Any) -> str | None:
    """Why a capture's budget is no activation_memory_budget (None: it is one, or there is none)."""
    if isinstance(budget, float) and not math.isfinite(budget):
        return f"activation_memory_budget is {budget}, not a number in [0, 1]"
    return None


@dataclass(frozen=True)
class Keep:
    """Which steps a capture stores: every one (the default), the window `first`..`last`, or the
    last `keep_last` complete steps and the one in progress. `exit_after`: end the program once the
    window's last step is recorded (`memprof trace --exit-after`)."""

    first: int = 1
    last: int | None = None
    keep_last: int = 0
    exit_after: bool = False

    @staticmethod
    def of(steps: tuple[int, int] | None = None, keep_last: int | None = None, exit_after: bool = False,
           names: tuple[str, str, str] = ("steps", "keep_last", "exit_after")) -> Keep:
        """Checked: one-line MemprofErrors for a malformed window, a ring of no steps, or both given
        (`names`: the options' names in the messages, e.g. the CLI's)."""
        steps_name, keep_name, exit_name = names
        if steps is not None and keep_last is not None:
            raise MemprofError(f"{steps_name} and {keep_name} cannot be combined: {steps_name} A:B keeps steps A "
                               f"to B, {keep_name} N the last N steps of the run; give one of them")
        if exit_after and steps is None:
            raise MemprofError(f"{exit_name} ends the script after a step window: give the window ({steps_name} A:B)")
        if keep_last is not None:
            if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
                raise MemprofError(f"{keep_name} must be a whole number of steps, at least 1; got {keep_last!r}")
            return Keep(keep_last=keep_last)
        if steps is None:
            return Keep()
        if (not isinstance(steps, tuple | list) or len(steps) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in steps)):
            raise MemprofError(f"{steps_name} must be a window A:B of two step numbers, got {steps!r}")
        first, last = steps
        if first < 1 or last < first:
            raise MemprofError(f"{steps_name} {first}:{last} is not a window: steps count from 1 and need A <= B")
        return Keep(first=first, last=last, exit_after=exit_after)

    def to_meta(self) -> dict[str, Any]:
        if self.keep_last:
            return {"keep_last": self.keep_last}
        return {"window": [self.first, self.last]} if self.last is not None else {}


@dataclass(frozen=True)
class CaptureInfo:
    """What the analysis reads from a capture's metadata (`Capture.meta`, stored as meta.json), typed."""

    t_start_ns: int = 0
    t_stop_ns: int = 0
    baselines: dict[str, tuple[int, int]] = field(default_factory=dict)  # device -> (allocated, reserved)
    preexisting: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # device -> [(ptr, bytes)]
    main_thread: int | None = None  # thread index of the capturing thread
    reserved_tracked: bool = False  # the CUDA allocator tracker was attached: segment events exist
    dropped_events: int = 0
    first_dropped_ns: int | None = None
    max_events: int = 0
    steps: int = 0  # step markers the script made
    status: str | None = None  # completed | exit | exception | oom | interrupted | stopped | memprof-error
    stopped_by: str | None = None  # "torch.profiler" when it stopped the capture early
    cpu_threads: str | None = None  # "all", or why other threads' CPU events are missing
    dataloader_workers: int = 0
    child_processes: int = 0
    recompile_limits: tuple[str, ...] = ()
    graph_breaks: tuple[str, ...] = ()  # where Dynamo broke graphs while the capture ran, and why
    device_total: dict[str, int] = field(default_factory=dict)  # device -> its memory (bytes)
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF when the capture started
    recovered_from: str | None = None  # the spill this capture was recovered from (the run was cut short)
    window: tuple[int, int] | None = None  # the step window the capture stored (`Keep`)
    keep_last: int = 0  # the capture stored a ring of the last steps (`Keep`)
    window_state: str | None = None  # the window at the end: "pending" (it never opened), "open", "closed"
    ended_by: str | None = None  # "exit-after": memprof ended the script after the window
    rank: int | None = None  # this capture's rank in a distributed run (`memprof.ranks`), None outside one
    world_size: int | None = None
    backend: str | None = None  # the process group's ("gloo", "nccl"), when the script made one

    options_after_script: tuple[str, ...] = ()  # memprof's options that came after SCRIPT
    spill_live: bool = False  # recovered from the spill of a run still going (its writer holds it)
    first_in_process: bool = False  # no capture ran before it in its process (no CPU block was seen before)
    # fallback calls' scratch, probed when the capture was made: call -> [bytes or None, why not]
    scratch_probes: dict[str, list[Any]] | None = None
    # plan index -> the tangents whose storage outlived the compiled backward's first call (those it
    # did not free: the engine or the script held them), for the plans whose backward ran
    tangents_kept: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @staticmethod
    def from_meta(meta: dict[str, Any]) -> CaptureInfo:
        """Read through `META`: a field that is not what it declares counts as absent (the loader
        refuses a file with one; a capture in memory is memprof's own)."""
        dist = _get(meta, "distributed")
        window = _get(meta, "window")
        return CaptureInfo(
            t_start_ns=_get(meta, "t_start_ns", 0), t_stop_ns=_get(meta, "t_stop_ns", 0),
            baselines={d: (int(b.get("allocated", 0)), int(b.get("reserved", 0)))
                       for d, b in _get(meta, "baselines", {}).items()},
            preexisting={d: [(int(p), int(b)) for p, b in blocks]
                         for d, blocks in _get(meta, "preexisting", {}).items()},
            main_thread=_get(meta, "main_thread"), reserved_tracked=meta.get("cuda_tracker") == "attached",
            dropped_events=_get(meta, "dropped_events", 0), first_dropped_ns=_get(meta, "first_dropped_ns"),
            max_events=_get(meta, "max_events", 0), steps=_get(meta, "steps", 0), status=_get(meta, "status"),
            stopped_by=_get(meta, "stopped_by") or None, cpu_threads=_get(meta, "cpu_threads"),
            dataloader_workers=_get(meta, "dataloader_workers", 0), child_processes=_get(meta, "child_processes", 0),
            recompile_limits=tuple(_get(meta, "recompile_limits", ())),
            graph_breaks=tuple(_get(meta, "graph_breaks", ())),
            device_total=dict(_get(meta, "device_total", {})),
            alloc_conf=_get(meta, "alloc_conf"), recovered_from=_get(meta, "recovered_from"),
            window=(window[0], window[1]) if window else None, keep_last=_get(meta, "keep_last", 0),
            window_state=_get(meta, "window_state"), ended_by=_get(meta, "ended_by"),
            rank=dist["rank"] if dist else None, world_size=dist["world_size"] if dist else None,
            backend=dist.get("backend") if dist else None,
            options_after_script=tuple(_get(meta, "options_after_script", ())),
            spill_live=_get(meta, "status") == "running" and _get(meta, "recovered_from") is not None,
            first_in_process=_get(meta, "first_in_process", False),
            scratch_probes=_get(meta, "scratch_probes"),
            tangents_kept={int(k): tuple(v) for k, v in _get(meta, "tangents_kept", {}).items()},
        )
