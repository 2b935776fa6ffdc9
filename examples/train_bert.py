"""Train a BERT-style model (random weights, dropout on) with torch.compile and AdamW.

    python examples/train_bert.py                  # small and fast, CPU (CUDA when present)
    python examples/train_bert.py --paper          # the paper's 32-layer BERT, batch (2, 1024)
    memprof trace examples/train_bert.py --budget 0.05

The paper configuration (notes/seed-paper.md): BertModel without pooler, 32 layers, hidden 192,
3 heads, MLP 768, vocab 1000, max positions 1024, eager attention, dropout 0.1 (train mode),
input ids (2, 1024), fp32, loss = last_hidden_state.sum(), seed 197838.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BertSize:
    layers: int
    hidden: int
    heads: int
    mlp: int
    vocab: int
    seq: int
    batch: int


SMALL = BertSize(layers=2, hidden=64, heads=4, mlp=256, vocab=1000, seq=64, batch=2)
PAPER = BertSize(layers=32, hidden=192, heads=3, mlp=768, vocab=1000, seq=1024, batch=2)


def build(size: BertSize, device: str, seed: int = 197838) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (train mode, so dropout is on) and a batch of random token ids on `device`."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.mlp,
        max_position_embeddings=max(512, size.seq),
        attn_implementation="eager",
    )
    model = BertModel(config, add_pooling_layer=False).to(device).train()
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), device=device)
    return model, ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", action="store_true", help="the paper's 32-layer configuration")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=None, help="override the batch size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true", help="run eagerly")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--no-optimizer", action="store_true",
                        help="forward+backward only, gradients kept allocated between steps "
                        "(zero_grad(set_to_none=False)): the paper's reference measurement")
    args = parser.parse_args(argv)

    size = PAPER if args.paper else SMALL
    if args.batch:
        size = BertSize(**{**size.__dict__, "batch": args.batch})
    model, ids = build(size, args.device)
    step_fn = model if args.no_compile else torch.compile(model)
    opt = None if args.no_optimizer else torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        loss = step_fn(input_ids=ids).last_hidden_state.sum()
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
