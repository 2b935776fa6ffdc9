"""Train a Llama-style model (random weights, no download) with torch.compile and AdamW.

    python examples/train_llama.py                 # small and fast, CPU (CUDA when present)
    python examples/train_llama.py --paper         # the paper's 32-layer model, batch (2, 1024)
    python examples/train_llama.py --vary-seq      # the sequence length changes every step
    memprof trace examples/train_llama.py --budget 0.05

The paper configuration (notes/seed-paper.md): LlamaModel with 32 layers, hidden 256,
8 heads (8 KV heads), MLP 688, vocab 1000, input ids (2, 1024), fp32,
loss = last_hidden_state.sum(), seed 197838.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LlamaSize:
    layers: int
    hidden: int
    heads: int
    mlp: int
    vocab: int
    seq: int
    batch: int


SMALL = LlamaSize(layers=2, hidden=64, heads=4, mlp=172, vocab=1000, seq=64, batch=2)
PAPER = LlamaSize(layers=32, hidden=256, heads=8, mlp=688, vocab=1000, seq=1024, batch=2)


def build(size: LlamaSize, device: str, seed: int = 197838) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (train mode) and a batch of random token ids on `device`."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.mlp,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        max_position_embeddings=max(2048, size.seq),
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaModel(config).to(device).train()
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), device=device)
    return model, ids


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).last_hidden_state.sum()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", action="store_true", help="the paper's 32-layer configuration")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=None, help="override the batch size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="run eagerly")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--vary-seq", action="store_true",
                        help="a dynamic-shape loop: step k runs the first seq - 16 (k - 1) tokens")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="forward+backward only, gradients kept allocated between steps "
                        "(zero_grad(set_to_none=False)): the paper's reference measurement")
    args = parser.parse_args(argv)

    size = PAPER if args.paper else SMALL
    if args.batch:
        size = LlamaSize(**{**size.__dict__, "batch": args.batch})
    model, ids = build(size, args.device)
    step_fn = model if args.no_compile else torch.compile(model)
    opt = None if args.no_optimizer else torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        batch = ids[:, : max(16, size.seq - 16 * (step - 1))] if args.vary_seq else ids
        loss = step_fn(input_ids=batch).last_hidden_state.sum()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=False)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        print(f"step {step}: loss {loss.item():.4f} ({(time.perf_counter() - t) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
