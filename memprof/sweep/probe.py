"""Scratch memory of fallback kernels, measured once per call signature on placeholder inputs.

Inductor's wrapper shows what a fallback kernel returns, not what it allocates while it runs: the
memory-efficient attention backward, for one, allocates four buffers on top of its gradients
(docs/benchmarks.md, "Figures behind design choices"). memprof's estimate learns that from the kernel
itself: each distinct call (op, argument shapes, strides, dtypes, constants; recorded at
partition time as `FxNode.call`) runs twice on zero-filled inputs under a memprof capture, outside
any user capture, and its scratch is the peak during the second run above what the call leaves
allocated (its outputs). The first run absorbs one-time allocations (library workspaces kept for
the process). RNG state is forked, so a probe never changes what the user's program draws.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

_CACHE: dict[str, int | None] = {}
_WHY: dict[str, str] = {}  # spec -> why its scratch is not known


def _resolve(name: str) -> Any:
    import torch

    qual, _, overload = name.partition(".")
    ns, _, op = qual.partition("::")
    return getattr(getattr(getattr(torch.ops, ns), op), overload or "default")


def _build(a: Any, devices: list[Any]) -> Any:
    import torch

    if isinstance(a, dict):
        if "t" in a:
            shape, stride, dtype, device, offset = a["t"]
            need = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) if all(shape) else 0
            base = torch.zeros(max(need, 0), dtype=getattr(torch, dtype), device=device)
            devices.append(base.device)
            return base.as_strided(shape, stride, offset)
        if "l" in a:
            return [_build(x, devices) for x in a["l"]]
        if "dtype" in a:
            return getattr(torch, a["dtype"])
        if "device" in a:
            return torch.device(a["device"])
    return a


def scratch_bytes(spec: str) -> int | None:
    """Bytes a fallback call allocates above its outputs while it runs (None: not measurable here:
    its device is absent, a capture is running, or the call failed)."""
    if not spec:
        return 0
    if spec in _CACHE:
        return _CACHE[spec]
    import torch

    from memprof._native import native
    from memprof.session import capture

    try:
        if native().active():  # never inside the user's capture; not cached, a later call may probe
            _WHY[spec] = "a capture was running"
            return None
    except Exception:  # no native extension: nothing to measure with
        _CACHE[spec], _WHY[spec] = None, "memprof's native extension is not built"
        return None
    result: int | None = None
    try:
        d = json.loads(spec)
        op = _resolve(d["op"])
        devices: list[Any] = []
        args = [_build(a, devices) for a in d["args"]]
        kwargs = {k: _build(v, devices) for k, v in d["kwargs"].items()}
        device = devices[0] if devices else torch.device("cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            _CACHE[spec], _WHY[spec] = None, "its device (CUDA) is not here"
            return None
        forked = [device.index or 0] if device.type == "cuda" else []
        name = f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"
        with torch.no_grad(), torch.random.fork_rng(devices=forked):
            for _ in range(2):
                with capture(scopes="graphs", kernels=False, plans=False) as cap:
                    out = op(*args, **kwargs)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                tl = cap.timeline(name)
                end = int(tl.allocated[-1]) if len(tl.allocated) else tl.baseline
                result = max(0, tl.peak - end)
                del out
    except Exception as exc:  # an op that cannot run on placeholders: no scratch known, never a failure
        result = None
        _WHY[spec] = f"it failed on placeholder inputs ({type(exc).__name__})"
    _CACHE[spec] = result
    return result


def unprobed(nodes: Iterable[Any]) -> list[tuple[str, str]]:
    """(op, why) for each distinct fallback call among `nodes` whose scratch could not be measured
    (after `probe_graph_calls`): memprof's estimate leaves that scratch out."""
    out: dict[tuple[str, str], None] = {}
    for n in nodes:
        spec = getattr(n, "call", "")
        if spec and spec in _WHY and _CACHE.get(spec) is None:
            try:
                op = str(json.loads(spec)["op"])
            except (ValueError, KeyError, TypeError):
                op = "a fallback kernel"
            out[(op, _WHY[spec])] = None
    return list(out)


def probe_plans(plans: Iterable[Any]) -> dict[str, list[Any]]:
    """Every distinct fallback call of `plans` probed now, call -> [scratch bytes or None, why not]:
    what `memprof trace` records in the capture (`scratch_probes`), so that a later `memprof report`
    gives the same estimate without importing torch or running a kernel (`preload`)."""
    out: dict[str, list[Any]] = {}
    for plan in plans:
        for n in (*plan.forward.nodes, *plan.backward.nodes):
            spec = getattr(n, "call", "")
            if spec and spec not in out:
                scratch = scratch_bytes(spec)
                out[spec] = [scratch, _WHY.get(spec, "") if scratch is None else ""]
    return out


def preload(probes: dict[str, list[Any]] | None) -> None:
    """Take the probes a capture recorded (`probe_plans`) as measured, where this process has not
    probed the call itself."""
    for spec, (scratch, why) in (probes or {}).items():
        if spec not in _CACHE:
            _CACHE[spec] = scratch
            if scratch is None and why:
                _WHY[spec] = why


def probe_graph_calls(nodes: Iterable[Any]) -> dict[str, int]:
    """Node name -> scratch bytes, for the nodes of one graph that carry a call spec."""
    out: dict[str, int] = {}
    for n in nodes:
        if getattr(n, "call", ""):
            b = scratch_bytes(n.call)
            if b:
                out[n.name] = b
    return out
