"""The training loop the zoo's scripts share (`train_gpt2.py`, `train_gqa.py`, `train_vit.py`).

Each script describes its model (a size dataclass with `SMALL` and `FULL`, `build`, `loss_fn`,
`layers`) and calls `train`; this module holds what a plain training script around it does:
arguments, bf16 autocast or fp32, `torch.compile`, AdamW (fused where the device has it), the
loop and its step times. It is imported as a sibling module (`python examples/train_gpt2.py`
puts `examples/` first on `sys.path`, as it does under `memprof trace`).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch


@contextlib.contextmanager
def precision(device: str, dtype: str) -> Iterator[None]:
    """bf16 autocast (the weights stay fp32, matmuls run in bf16) or plain fp32."""
    if dtype == "bf16":
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
            yield
    else:
        yield


def parser(doc: str, default_dtype: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", "--paper", dest="full", action="store_true", help="the full-size configuration")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=None, help="override the batch size")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=default_dtype,
                   help="bf16: autocast around forward and loss; fp32: none")
    p.add_argument("--no-compile", action="store_true", help="run eagerly")
    p.add_argument("--lr", type=float, default=3e-4)
    return p


def sized(size: Any, args: argparse.Namespace) -> Any:
    """The size the arguments ask for: FULL or SMALL, with --batch and --layers applied."""
    over = {k: v for k, v in (("batch", args.batch), ("layers", args.layers)) if v}
    return replace(size, **over)


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW, fused (one kernel per step, no foreach temporaries); torch has it on CUDA and the CPU."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)


def token_batch(vocab: int, batch: int, seq: int, device: str) -> torch.Tensor:
    """Random token ids (batch, seq): a language model's inputs and, shifted by transformers, its labels."""
    return torch.randint(0, vocab, (batch, seq), device=device)


def causal_lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a transformers causal LM (it shifts the labels)."""
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def train(args: argparse.Namespace, model: torch.nn.Module, batch: Any,
          loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> None:
    """The loop: forward and loss under the chosen precision, backward, optimizer step, zero_grad."""
    step_fn: Any = model if args.no_compile else torch.compile(model)
    opt = optimizer(model, args.lr)
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        with precision(args.device, args.dtype):
            loss = loss_fn(step_fn, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        print(f"step {step}: loss {loss.item():.4f} ({(time.perf_counter() - t) * 1e3:.0f} ms)", flush=True)
