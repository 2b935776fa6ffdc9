"""Train a GPT-2-small decoder (random weights, no download): bf16 autocast, fused AdamW, torch.compile.

    python examples/train_gpt2.py                  # small and fast, CPU (CUDA when present)
    python examples/train_gpt2.py --full           # GPT-2 small: 12 layers, 768 wide, batch 12 x 1024
    python examples/train_gpt2.py --dtype fp32     # the same model without autocast
    memprof trace examples/train_gpt2.py --budget 0.05

The most common recipe (nanoGPT's): Hugging Face's GPT2LMHeadModel with SDPA attention, vocab
50,304 (50,257 padded to a multiple of 64), no dropout, next-token cross entropy on the logits
(which transformers up-casts to fp32), AdamW fused, bf16 autocast around the forward and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from _zoo import causal_lm_loss, parser, sized, token_batch, train


@dataclass(frozen=True)
class GPT2Size:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    dropout: float = 0.0


SMALL = GPT2Size(layers=2, hidden=64, heads=4, vocab=2048, seq=64, batch=4)
FULL = GPT2Size(layers=12, hidden=768, heads=12, vocab=50304, seq=1024, batch=12)
DTYPE = "bf16"


def build(size: GPT2Size, device: str, seed: int = 1337) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (train mode) and a batch of random token ids on `device` (also the labels)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=size.vocab, n_positions=max(1024, size.seq), n_embd=size.hidden,
                        n_layer=size.layers, n_head=size.heads, resid_pdrop=size.dropout,
                        embd_pdrop=size.dropout, attn_pdrop=size.dropout, use_cache=False,
                        bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM", attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).to(device).train()
    return model, token_batch(size.vocab, size.batch, size.seq, device)


loss_fn = causal_lm_loss


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.transformer.h)  # type: ignore[union-attr, arg-type]


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__ or "", DTYPE)
    p.add_argument("--dropout", type=float, default=None, help="dropout on embeddings, attention and residuals")
    args = p.parse_args(argv)
    size = sized(FULL if args.full else SMALL, args)
    if args.dropout is not None:
        size = replace(size, dropout=args.dropout)
    model, ids = build(size, args.device)
    train(args, model, ids, loss_fn)


if __name__ == "__main__":
    main()
