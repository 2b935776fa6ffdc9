"""`CaptureInfo`: what the analysis reads from a capture's metadata (`Capture.meta`), typed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _int(value: Any, default: int = 0) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


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

    @staticmethod
    def from_meta(meta: dict[str, Any]) -> CaptureInfo:
        baselines = {str(d): (_int(b.get("allocated")), _int(b.get("reserved")))
                     for d, b in (meta.get("baselines") or {}).items() if isinstance(b, dict)}
        pre = {str(d): [(int(p), int(b)) for p, b in blocks] for d, blocks in (meta.get("preexisting") or {}).items()}
        main, first = meta.get("main_thread"), meta.get("first_dropped_ns")
        limits = meta.get("recompile_limits")
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
        )
