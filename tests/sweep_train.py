"""A training script for the sweep tests: TinyLlama (tests/remat_models.py), forward+backward only,
gradients kept allocated (the reference measurement), compiled with aot_eager (fast on CPU).

    python tests/sweep_train.py [--layers 6] [--d 128] [--seq 256] [--steps 3] [--backend aot_eager] [--eager]
    python tests/sweep_train.py --crash-below 0.02    # raise inside the step when the budget is below 0.02
    python tests/sweep_train.py --crash-before-backward  # raise between the first forward and its backward
"""

from __future__ import annotations

import argparse
import os

import torch
import torch._functorch.config as functorch_config
from remat_models import TinyLlama, projection_loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--eager", action="store_true", help="never call torch.compile")
    p.add_argument("--crash-below", type=float, default=None)
    p.add_argument("--crash-before-backward", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    model = TinyLlama(layers=args.layers, d=args.d, heads=4, mlp=int(args.d * 2.7), vocab=128)
    ids = torch.randint(0, 128, (2, args.seq))
    fn = model if args.eager else torch.compile(model, backend=args.backend)
    for _ in range(args.steps):
        loss = projection_loss(fn(ids))
        if args.crash_before_backward:
            raise RuntimeError("deliberate failure before the backward")
        loss.backward()
        if args.crash_below is not None and functorch_config.activation_memory_budget < args.crash_below:
            raise RuntimeError(f"deliberate failure at budget {functorch_config.activation_memory_budget}")
        model.zero_grad(set_to_none=False)
    print("loss", float(loss))
    print("compile threads", os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"))
    print("cpu threads", torch.get_num_threads())


if __name__ == "__main__":
    main()
