"""Train a grouped-query-attention decoder (Mistral/Qwen-style; random weights, no download).

    python examples/train_gqa.py                   # small and fast, CPU (CUDA when present)
    python examples/train_gqa.py --full            # 24 layers, 1024 wide, 16 heads over 4 KV heads
    python examples/train_gqa.py --dtype fp32      # the same model without autocast
    memprof trace examples/train_gqa.py --budget 0.05

Hugging Face's MistralForCausalLM: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
attention (SDPA), untied embeddings; next-token cross entropy, fused AdamW, bf16 autocast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from _zoo import causal_lm_loss, parser, sized, token_batch, train


@dataclass(frozen=True)
class GQASize:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    seq: int
    batch: int


SMALL = GQASize(layers=2, hidden=64, heads=4, kv_heads=2, mlp=176, vocab=2048, seq=64, batch=4)
FULL = GQASize(layers=24, hidden=1024, heads=16, kv_heads=4, mlp=2816, vocab=32000, seq=1024, batch=4)
DTYPE = "bf16"


def build(size: GQASize, device: str, seed: int = 1337) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model (train mode) and a batch of random token ids on `device` (also the labels)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.mlp,
                           num_hidden_layers=size.layers, num_attention_heads=size.heads,
                           num_key_value_heads=size.kv_heads, max_position_embeddings=max(4096, size.seq),
                           sliding_window=None, use_cache=False, bos_token_id=0, eos_token_id=0,
                           loss_type="ForCausalLM", attn_implementation="sdpa")
    model = MistralForCausalLM(config).to(device).train()
    return model, token_batch(size.vocab, size.batch, size.seq, device)


loss_fn = causal_lm_loss


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)  # type: ignore[union-attr, arg-type]


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__ or "", DTYPE).parse_args(argv)
    model, ids = build(sized(FULL if args.full else SMALL, args), args.device)
    train(args, model, ids, loss_fn)


if __name__ == "__main__":
    main()
