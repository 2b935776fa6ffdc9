"""The peak summary of a capture, as plain data (reporters format it)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from memprof._events import Kind, device_name
from memprof.capture import Capture
from memprof.timeline import unfollowed_count


def fmt_bytes(n: int | None) -> str:
    """Human-readable size in decimal units (MB = 1e6 bytes, as the paper and nvidia-smi use)."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if v < 1000 or unit == "TB":
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.1f} {unit}"
        v /= 1000
    raise AssertionError("unreachable")


def summarize(cap: Capture, top: int = 8) -> dict[str, Any]:
    """Peak per device, the largest live allocations and scopes at each peak, steps, OOMs."""
    raw = cap.raw
    meta = cap.meta
    t0 = int(meta.get("t_start_ns", raw["t_ns"][0] if len(raw) else 0))
    t1 = int(meta.get("t_stop_ns", raw["t_ns"][-1] if len(raw) else t0))
    devices: list[dict[str, Any]] = []
    for dev in cap.devices:
        tl = cap.timeline(dev)
        live = cap.live_at_peak(dev)
        captured = sum(a.bytes for a in live)
        peak_t = int(tl.t_ns[tl.peak_pos]) if tl.peak_pos >= 0 else t0
        by_scope: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for a in live:
            by_scope[a.scope or "(no scope)"][0] += a.bytes
            by_scope[a.scope or "(no scope)"][1] += 1
        scopes = sorted(by_scope.items(), key=lambda kv: -kv[1][0])[:top]
        devices.append({
            "device": dev,
            "peak_bytes": tl.peak,
            "peak_t_s": (peak_t - t0) / 1e9,
            "baseline_bytes": tl.baseline,
            "final_bytes": tl.final,
            "reserved_peak_bytes": tl.reserved_peak if tl.has_reserved else None,
            "live_at_peak": len(live),
            "allocated_before_capture_bytes": tl.peak - captured,
            "inferred_sizes": tl.inferred,
            "stack_at_peak": cap.scope_stack_at_peak(dev),
            "largest": [
                {"bytes": a.bytes, "requested": a.requested, "scope": a.scope,
                 "age_ms": (peak_t - a.t_ns) / 1e6, "ptr": a.ptr}
                for a in live[:top]
            ],
            "scopes": [{"scope": s, "bytes": b, "count": c} for s, (b, c) in scopes],
            "steps": [
                {"step": s.step, "peak_bytes": s.peak, "allocated_at_end": s.allocated_at_end,
                 "reserved_at_end": s.reserved_at_end, "complete": s.complete}
                for s in cap.steps(dev)
            ],
        })
    oom_rows = np.flatnonzero(raw["kind"] == Kind.OOM)
    ooms = [
        {"device": device_name(int(raw["device_type"][r]), int(raw["device_index"][r])),
         "requested_bytes": int(raw["bytes"][r]),
         "free_bytes": int(raw["aux"][r]) if int(raw["aux"][r]) >= 0 else None,
         "t_s": (int(raw["t_ns"][r]) - t0) / 1e9, "scope": cap.scope_name(int(raw["scope"][r]))}
        for r in oom_rows
    ]
    return {
        "path": meta.get("path"),
        "command": meta.get("command"),
        "budget": meta.get("budget"),
        "status": meta.get("status"),
        "exit_code": meta.get("exit_code"),
        "error": meta.get("error"),
        "events": len(raw),
        "duration_s": (t1 - t0) / 1e9,
        "dropped_events": cap.dropped,
        "max_events": meta.get("max_events"),
        "unfollowed_events": unfollowed_count(raw),
        "cuda_tracker": meta.get("cuda_tracker"),
        "devices": devices,
        "ooms": ooms,
        "notes": list(meta.get("notes", [])),
    }
