"""Small models for the remat tests: Llama-style (RMSNorm, causal SDPA, SwiGLU, residual), a
dropout-free post-norm MLP stack, and a BERT-style encoder with dropout. Loss: a fixed random
projection of the output (a plain sum after a norm is ~0 by construction)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.input_layernorm = RMSNorm(d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate_proj = nn.Linear(d, mlp, bias=False)
        self.up_proj = nn.Linear(d, mlp, bias=False)
        self.down_proj = nn.Linear(mlp, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.input_layernorm(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h)),
                                           is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self, layers: int = 4, d: int = 64, heads: int = 4, mlp: int = 172, vocab: int = 128) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, heads, mlp) for _ in range(layers))
        self.norm = RMSNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int, p: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class MLPStack(nn.Module):
    """Post-norm residual MLP blocks (dropout-free unless p > 0)."""

    def __init__(self, layers: int = 4, d: int = 64, hidden: int = 256, p: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(d, hidden, p) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class BertBlock(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.ln2 = nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        probs = self.drop(torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1))
        a = (probs @ v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.drop(self.out(a)))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class TinyBert(nn.Module):
    """BERT-style encoder with dropout on attention probabilities and hidden states."""

    def __init__(self, layers: int = 3, d: int = 64, heads: int = 4, vocab: int = 128, p: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.drop = nn.Dropout(p)
        self.layers = nn.ModuleList(BertBlock(d, heads, p) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.ln(self.embed(ids)))
        for layer in self.layers:
            x = layer(x)
        return x


def projection_loss(out: torch.Tensor, seed: int = 4242) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(out.shape[-1], generator=g).to(out.device)
    return (out * r).sum() / out[..., 0].numel()
