"""What a capture notes about where it ran: versions and host, each device's memory when it
started, and whether the CUDA allocator tracker could be attached."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

from memprof._version import __version__
from memprof.torch_hooks import runtime


def base_meta() -> dict[str, Any]:
    import torch

    return {
        "memprof_version": __version__,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "pid": os.getpid(),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "notes": [],
    }


def distributed_at_start() -> dict[str, Any]:
    """The rank the launcher gave this process (`memprof.ranks`), or nothing outside a distributed launch."""
    from memprof.ranks import launched_rank

    rank = launched_rank()
    return {"distributed": rank.to_meta()} if rank is not None else {}


def note_backend(meta: dict[str, Any]) -> None:
    """The process group's backend, once the script has made one (at each step and at the stop: a
    script may destroy its group before it ends)."""
    dist = sys.modules.get("torch.distributed")
    d = meta.get("distributed")
    if isinstance(d, dict) and "backend" not in d and dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                d["backend"] = str(dist.get_backend())
        except Exception:  # (a group already destroyed)
            pass


def devices_at_start(cuda_ready: bool) -> dict[str, Any]:
    """Each device's allocated and reserved bytes when the capture starts, the CUDA blocks live then
    (`cuda_ready`: CUDA is initialized), the allocator settings."""
    import torch

    out: dict[str, Any] = {}
    baselines: dict[str, dict[str, int]] = {"cpu": {"allocated": 0, "reserved": 0}}
    if cuda_ready:
        out["preexisting"] = runtime.cuda_live_blocks()
        for d in range(torch.cuda.device_count()):
            baselines[f"cuda:{d}"] = {
                "allocated": int(torch.cuda.memory_allocated(d)),
                "reserved": int(torch.cuda.memory_reserved(d)),
            }
    out.update(alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), baselines=baselines,
               cpu_note="cpu: bytes allocated during the capture (PyTorch does not report earlier ones)")
    if torch.cuda.is_available():
        out["allocator_backend"] = torch.cuda.get_allocator_backend()
    return out


def tracker_attached(meta: dict[str, Any], problem: str, note: Callable[[str], None]) -> None:
    """Record the CUDA tracker's attachment (`problem`: "" or why it failed) and the devices' sizes."""
    import torch

    if not problem:
        meta["cuda_tracker"] = "attached"
        for d in range(torch.cuda.device_count()):
            meta["baselines"].setdefault(f"cuda:{d}", {"allocated": 0, "reserved": 0})
            meta.setdefault("device_total", {})[f"cuda:{d}"] = int(torch.cuda.get_device_properties(d).total_memory)
        return
    meta["cuda_tracker"] = f"unavailable: {problem}"
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        note("the cudaMallocAsync allocator backend supports no allocator tracing, and on torch 2.11 it reports "
             "no CUDA allocations to PyTorch's memory reporter either: memprof captures CPU allocations and "
             "scopes only; use the default (native) backend")
    else:
        note(f"CUDA allocator tracing unavailable ({problem}): reserved bytes are missing")
