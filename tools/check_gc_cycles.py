"""Does Python's cyclic garbage collector hold a compiled step's memory? Plain torch (memprof is not
imported): compile an example at a budget, run steps, and after the compiling step and each later
one collect with `gc.DEBUG_SAVEALL` to see what was unreachable, found by that collection or by the
automatic ones during the step (object kinds, real tensors and their bytes, what refers to the
largest), and how much device memory freeing it gave back.
Also the step peaks as the paper's reference measurement takes them (`max_memory_allocated()` above the step's
start), with the collector on or (`--no-gc`, between collections) off.

    python tools/check_gc_cycles.py --budget 0.1 --paper            # H200
    python tools/check_gc_cycles.py --budget 0.1 --no-gc

The last output is the table: per step, the peak, the unreachable objects, the real tensors among
them, and the device bytes the collection freed.
"""

from __future__ import annotations

import argparse
import collections
import gc
from typing import Any

from _examples import load_example  # (tools/, on the path as this script's folder)


def _describe_referrers(t: Any, skip: list[Any]) -> list[str]:
    out = []
    for r in gc.get_referrers(t):
        if any(r is s for s in skip):
            continue
        if type(r).__name__ == "frame":
            out.append(f"frame {r.f_code.co_filename.split('site-packages/')[-1]}:{r.f_code.co_name}")
        elif isinstance(r, dict):
            out.append("dict[" + ",".join(str(k) for k, v in r.items() if v is t)[:60] + "]")
        else:
            out.append(type(r).__name__)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", choices=("llama", "bert"), default="llama")
    p.add_argument("--paper", action="store_true", help="the paper's configuration")
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--steps", type=int, default=3, help="steps, the first of which compiles")
    p.add_argument("--no-gc", action="store_true", help="the collector off during the steps")
    ns = p.parse_args()

    import torch
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensor

    ex = load_example(ns.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    functorch_config.activation_memory_budget = ns.budget
    model, ids = ex.build(ex.PAPER if ns.paper else ex.SMALL, device)
    fn = torch.compile(model)
    cuda = device == "cuda"
    rows = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # a collection keeps what it found in gc.garbage
    for i in range(ns.steps):
        if ns.no_gc:
            gc.disable()
        base = 0
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        fn(input_ids=ids).last_hidden_state.sum().backward()  # type: ignore[no-untyped-call]
        model.zero_grad(set_to_none=False)
        peak = None
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        gc.enable()
        gc.collect()
        unreachable = len(gc.garbage)  # what this collection and the step's automatic ones found
        tensors = [o for o in gc.garbage if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor)
                   and o.device.type != "meta"]
        tensor_bytes: collections.Counter[str] = collections.Counter()
        for t in tensors:
            tensor_bytes[str(t.device)] += t.untyped_storage().nbytes()
        kinds = collections.Counter(type(o).__name__ for o in gc.garbage)
        print(f"step {i}: {unreachable} unreachable objects, most: {kinds.most_common(8)}")
        tensors.sort(key=lambda t: -t.untyped_storage().nbytes())
        for t in tensors[:8]:
            print(f"  tensor {tuple(t.shape)} {t.dtype} {t.device} {t.untyped_storage().nbytes():,} B, "
                  f"referred to by {_describe_referrers(t, [gc.garbage, tensors])[:5]}")
        gc.set_debug(0)  # now free them, and see what the device gets back
        before = torch.cuda.memory_allocated() if cuda else 0
        gc.garbage.clear()
        del tensors
        gc.collect()
        freed = before - torch.cuda.memory_allocated() if cuda else None
        gc.set_debug(gc.DEBUG_SAVEALL)
        rows.append((i, peak, unreachable, dict(tensor_bytes), freed))
    print(f"| step | peak B (allocator above the step's start) | unreachable objects | real tensors among them, "
          f"bytes by device | {device} bytes the collection freed |")
    print("|---|---|---|---|---|")
    for i, peak, unreachable, tb, freed in rows:
        print(f"| {i} | {peak if peak is not None else 'n/a'} | {unreachable} | {tb or '-'} | "
              f"{freed if freed is not None else 'n/a'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
