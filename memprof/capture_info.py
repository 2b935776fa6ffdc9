"""`CaptureInfo`: what the analysis reads from a capture's metadata (`Capture.meta`), typed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memprof.errors import MemprofError


def _int(value: Any, default: int = 0) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


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

    @staticmethod
    def from_meta(meta: dict[str, Any]) -> CaptureInfo:
        baselines = {str(d): (_int(b.get("allocated")), _int(b.get("reserved")))
                     for d, b in (meta.get("baselines") or {}).items() if isinstance(b, dict)}
        pre = {str(d): [(int(p), int(b)) for p, b in blocks] for d, blocks in (meta.get("preexisting") or {}).items()}
        main, first = meta.get("main_thread"), meta.get("first_dropped_ns")
        limits = meta.get("recompile_limits")
        window = meta.get("window")
        dist = meta.get("distributed") if isinstance(meta.get("distributed"), dict) else None
        return CaptureInfo(
            t_start_ns=_int(meta.get("t_start_ns")), t_stop_ns=_int(meta.get("t_stop_ns")), baselines=baselines,
            preexisting=pre, main_thread=main if isinstance(main, int) else None,
            reserved_tracked=meta.get("cuda_tracker") == "attached", dropped_events=_int(meta.get("dropped_events")),
            first_dropped_ns=first if isinstance(first, int) and first >= 0 else None,
            max_events=_int(meta.get("max_events")), steps=_int(meta.get("steps")),
            status=meta.get("status") if isinstance(meta.get("status"), str) else None,
            stopped_by=meta.get("stopped_by") or None,
            cpu_threads=meta.get("cpu_threads") if isinstance(meta.get("cpu_threads"), str) else None,
            dataloader_workers=_int(meta.get("dataloader_workers")), child_processes=_int(meta.get("child_processes")),
            recompile_limits=tuple(str(x) for x in limits) if isinstance(limits, list) else (),
            device_total={str(d): _int(v) for d, v in (meta.get("device_total") or {}).items()},
            alloc_conf=meta.get("alloc_conf") if isinstance(meta.get("alloc_conf"), str) else None,
            recovered_from=meta.get("recovered_from") if isinstance(meta.get("recovered_from"), str) else None,
            window=(int(window[0]), int(window[1])) if isinstance(window, list) and len(window) == 2 else None,
            keep_last=_int(meta.get("keep_last")),
            window_state=meta.get("window_state") if isinstance(meta.get("window_state"), str) else None,
            ended_by=meta.get("ended_by") if isinstance(meta.get("ended_by"), str) else None,
            rank=_int(dist.get("rank"), -1) if dist else None,
            world_size=_int(dist.get("world_size")) if dist else None,
            backend=dist.get("backend") if dist and isinstance(dist.get("backend"), str) else None,
        )
