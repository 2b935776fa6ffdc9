"""Write the small captures committed under tests/fixtures/ (run from the repository root).

    python tools/make_fixtures.py

`tiny_compiled.memprof`: a two-layer MLP compiled with Inductor on the CPU, three AdamW steps, so
that the file has every member (events, strings, threads, plans, wrapper sources). Tests read it
instead of compiling a model; the fuzz test of the loader mutates it.
"""

from __future__ import annotations

from pathlib import Path

import torch

import memprof

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def tiny_compiled() -> memprof.Capture:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memprof.capture(meta={"command": "tools/make_fixtures.py tiny_compiled"}) as cap:
        compiled = torch.compile(model)
        for _ in range(3):
            compiled(torch.randn(16, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    return cap


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    path = tiny_compiled().save(OUT / "tiny_compiled.memprof")
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
