"""Known tensors: which blocks are parameters, gradients and optimizer state, by pointer and time,
as seen in the live modules and at each optimizer step (`memprof.plans.KnownTensor`). The capture's
plan recorder is one (`PlanRecorder`); what it records names blocks in the analysis.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from memprof._events import device_name
from memprof._native import native
from memprof.plans import KnownTensors

_FULL_WALK_EVERY = 16  # optimizer steps between walks of its parameters and state (`record_optimizer`)


def _is_fake(tensor: Any) -> bool:
    """Whether `tensor` is a FakeTensor (compile-time, no memory). A plain tensor or parameter that
    wraps none is told at once (torch's `is_fake` takes microseconds, at every gradient of every step)."""
    import torch

    if type(tensor) in (torch.Tensor, torch.nn.Parameter) and not torch._is_functional_tensor(tensor):
        return False
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(tensor))


def live_instances(cls: type) -> list[Any]:
    """Every object the garbage collector tracks that is an instance of `cls` (the live modules,
    optimizers)."""
    found = []
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, cls):
                    found.append(o)
            except ReferenceError:  # a weakref.proxy whose object is gone
                continue
    return found


class KnownTensorRecorder:
    """The known tensors seen so far (`tensors`), from the modules and the optimizer steps."""

    def __init__(self, now_ns: Callable[[], int]) -> None:
        self.now_ns = now_ns
        self.tensors = KnownTensors()
        self.tensors_pruned = 0  # times `prune_tensors` dropped records (the spill then writes them anew)
        self.record_tensors = True  # False once a step window closed: later records could name nothing
        # (category, name) -> (weak reference, storage pointer, storage bytes, the tensor's data pointer)
        self._last_seen: dict[tuple[str, str], tuple[Any, int, int, int]] = {}
        self._param_names: dict[int, str] = {}
        self._scanned_for: set[int] = set()  # optimizers whose unnamed parameters sent us to the modules
        # per optimizer: (parameters, state entries) when last walked whole, steps since, (parameter, name)
        self._walks: dict[int, list[Any]] = {}

    def prune_tensors(self, before_ns: int) -> None:
        """Keep only the records a capture storing the events from `before_ns` on needs (`KnownTensors.pruned`)."""
        kept = self.tensors.pruned(before_ns)
        if kept is not None:
            self.tensors = kept
            self.tensors_pruned += 1

    def _add_tensor(self, t_ns: int, tensor: Any, category: str, name: str) -> None:
        if not self.record_tensors:
            return
        # the same tensor at the same address as when last seen under this name names the same block:
        # one record for a parameter or optimizer state is enough, however many steps. Told first, by
        # the tensor's own data pointer (the checks below cost microseconds a tensor, and an optimizer
        # step visits every parameter, gradient and state: milliseconds a step on a host-bound run)
        seen = self._last_seen.get((category, name))
        if seen is not None and seen[0]() is tensor:
            with contextlib.suppress(Exception):
                if tensor.data_ptr() == seen[3]:
                    return
        try:
            if tensor.device.type == "meta" or getattr(tensor, "is_fake", False) or _is_fake(tensor):
                return
            # a DTensor (FSDP2's sharded parameters and their optimizer state): its local shard holds the memory
            local = getattr(tensor, "_local_tensor", None)
            storage = (local if local is not None else tensor).untyped_storage()
            ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
            data_ptr = int(tensor.data_ptr()) if local is None else -1
        except Exception:
            return
        if not ptr or not nbytes:
            return
        if seen is not None and seen[0]() is tensor and seen[1:3] == (ptr, nbytes):
            return
        with contextlib.suppress(TypeError):  # (a tensor subclass without weak references: recorded each time)
            self._last_seen[(category, name)] = (weakref.ref(tensor), ptr, nbytes, data_ptr)
        device = str(tensor.device) if tensor.device.type != "cuda" else f"cuda:{tensor.device.index or 0}"
        self.tensors.add(t_ns, device, ptr, nbytes, category, name)

    def record_modules(self) -> None:
        """Parameters and buffers of every live nn.Module (names from the outermost modules)."""
        import torch

        modules = live_instances(torch.nn.Module)
        children = {id(c) for m in modules for c in m.children()}
        t = self.now_ns()
        seen: set[int] = set()
        for root in modules:
            if id(root) in children:
                continue
            for name, p in itertools.chain(root.named_parameters(), root.named_buffers()):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self._param_names[id(p)] = name.removeprefix("_orig_mod.")
                self._add_tensor(t, p, "parameter", name.removeprefix("_orig_mod."))

    def record_optimizer(self, optimizer: Any) -> None:
        """Parameters, gradients and optimizer state after an optimizer step. Parameters no compile
        named (an eager model: FSDP2's, DDP's) are named from the live modules, once per optimizer.

        Parameters and optimizer state are updated in place: they are walked at the first step, when
        the optimizer's parameters or state entries change in number, and every `_FULL_WALK_EVERY`
        steps (a tensor swapped in between is named from then on). Gradients, new tensors at every
        step where `zero_grad` sets them to None, are read at every step (`_record_gradients`)."""
        shape = (sum(len(g["params"]) for g in optimizer.param_groups), len(optimizer.state))
        walk = self._walks.get(id(optimizer))
        t = self.now_ns()
        if walk is not None and walk[0] == shape and walk[1] % _FULL_WALK_EVERY:
            walk[1] += 1
            self._record_gradients(t, walk[2], walk[3])
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if id(optimizer) not in self._scanned_for and any(id(p) not in self._param_names for p in params):
            self._scanned_for.add(id(optimizer))
            self.record_modules()
        names = {id(p): self._param_names.get(id(p), f"param_groups[{gi}][{pi}]")
                 for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])}
        watch = walk[3] if walk is not None and walk[0] == shape else native().GradWatch(params)
        gradients = [(p, names[id(p)] + ".grad") for p in params]
        self._walks[id(optimizer)] = [shape, 1, gradients, watch]
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._add_tensor(t, p, "parameter", names[id(p)])
                for key, value in optimizer.state.get(p, {}).items():
                    if hasattr(value, "untyped_storage"):
                        self._add_tensor(t, value, "optimizer_state", f"{names[id(p)]}.{key}")
        self._record_gradients(t, gradients, watch)

    def _record_gradients(self, t_ns: int, params: list[tuple[Any, str]], watch: Any) -> None:
        """The gradients of `params` ((parameter, its gradient's name) pairs, as `watch` holds them) that
        are other tensors than at the last step: read in C++ (`memprof._C.GradWatch`), where reading them
        here took microseconds a gradient (milliseconds a step on a model of hundreds of parameters); a
        subclass's or a fake one here."""
        if not self.record_tensors:
            return
        for index, ptr, nbytes, device_type, device_index in watch.changed().tolist():
            p, name = params[index]
            if ptr >= 0:
                self.tensors.add(t_ns, device_name(device_type, device_index), ptr, nbytes, "gradient", name)
            elif (grad := p.grad) is not None:
                self._add_tensor(t_ns, grad, "gradient", name)
