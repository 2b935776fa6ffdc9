"""Step windows and rings on CUDA, on an unmodified nanoGPT-style training script (bf16 autocast, fused
AdamW, compiled): what `--steps A:B` and `--keep-last N` store attributes, category by category and
step by step, as a full capture of the same command does. Blocks carried in from before the stored
steps (cuBLAS workspaces, optimizer state, the batch, the logits kept) take the category the full
capture gives them. The tolerance is what two full captures of the same command differ by (the same
bytes, so far: the test prints both)."""

from __future__ import annotations

from pathlib import Path

import pytest

import memprof

from ..conftest import run_memprof

pytestmark = pytest.mark.cuda

GPT = '''\
import argparse
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=14)
args = p.parse_args()
torch.manual_seed(1337)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2, self.h = nn.LayerNorm(d), nn.LayerNorm(d), h
        self.attn, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=50304, layers=4, d=256, h=4, block=128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.head.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


model = GPT().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
cmodel = torch.compile(model)
data = torch.randint(0, 50304, (100_000,))


def batch():
    ix = torch.randint(len(data) - 129, (8,))
    x = torch.stack([data[i:i + 128] for i in ix])
    y = torch.stack([data[i + 1:i + 129] for i in ix])
    return x.pin_memory().cuda(non_blocking=True), y.pin_memory().cuda(non_blocking=True)


X, Y = batch()
for it in range(args.steps):
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        logits, loss = cmodel(X, Y)
    X, Y = batch()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
print("loss", loss.item())
'''


def _categories(cap: memprof.Capture, step: int) -> dict[str, int]:
    return {r.key: r.bytes for r in cap.attribution(at=f"step:{step}", by="category", device="cuda:0")}


def _differ(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)}


def test_windows_and_rings_keep_the_full_captures_categories_on_cuda(tmp_path: Path) -> None:
    (tmp_path / "gpt.py").write_text(GPT)
    for name, extra in (("full", ()), ("full2", ()), ("window", ("--steps", "10:12")), ("ring", ("--keep-last", "3"))):
        res = run_memprof("trace", "gpt.py", "-o", f"{name}.memprof", *extra, cwd=tmp_path, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
    full, full2 = memprof.load(tmp_path / "full.memprof"), memprof.load(tmp_path / "full2.memprof")
    # (pinned host memory and non_blocking copies: a real capture holds nothing inconsistent)
    assert full.exact and full.problems == [] and full.peak("cuda:0") > 0, full.problems
    for name, steps in (("window", [10, 11, 12]), ("ring", [12, 13, 14])):
        part = memprof.load(tmp_path / f"{name}.memprof")
        assert [s.step for s in part.steps("cuda:0") if s.complete] == steps
        peaks = {s.step: s.peak for s in full.steps("cuda:0")}
        peaks2 = {s.step: s.peak for s in full2.steps("cuda:0")}
        for s in part.steps("cuda:0"):
            if s.complete:
                assert abs(s.peak - peaks[s.step]) <= abs(peaks2[s.step] - peaks[s.step]), (name, s.step)
        for step in steps:
            noise = _differ(_categories(full, step), _categories(full2, step))  # two runs of the same command
            got = _differ(_categories(full, step), _categories(part, step))
            print(f"{name} step {step}: full {_categories(full, step)}; differs by {got} (two full runs: {noise})")
            for key, delta in got.items():
                assert abs(delta) <= abs(noise.get(key, 0)), (name, step, key, delta, noise)


PINNED = '''\
import torch
from torch.utils.data import DataLoader, TensorDataset

early = torch.randn(1 << 18).pin_memory()  # a pinned block from before the capture, freed in it
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.AdamW(model.parameters())
data = TensorDataset(torch.randn(512, 64), torch.randn(512, 64))
for step, (x, y) in enumerate(DataLoader(data, batch_size=32, pin_memory=True, num_workers=2)):
    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    (model(x) - y).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 2:
        del early
'''


def test_pinned_memory_and_dataloader_workers_hold_nothing_inconsistent(tmp_path: Path) -> None:
    """The consistency checks (`Capture.problems`) hold for what real CUDA jobs do: pinned host memory,
    from before the capture and from a DataLoader's pinning thread, and non_blocking copies."""
    (tmp_path / "pinned.py").write_text(PINNED)
    res = run_memprof("trace", "pinned.py", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    cap = memprof.load(tmp_path / "pinned.memprof")
    assert cap.info.first_in_process and cap.problems == [] and cap.exact, cap.problems
    assert cap.peak("cuda:0") > 0 and len(cap.steps("cuda:0")) == 16
