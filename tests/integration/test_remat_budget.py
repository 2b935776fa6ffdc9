"""`memprof.remat.enable(budget=...)`: a budget in bytes in the API, planned as `memprof fit` would from
the script started again, then set for the block; a ratio set as it is; memprof's own commands keep
theirs. End to end on the CPU, under plain `python`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import memprof.remat

SCRIPT = '''
import sys

import torch
import torch._functorch.config as functorch_config

import memprof.remat

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
opt = torch.optim.AdamW(model.parameters())
step = torch.compile(model)
x = torch.randn(64, 64)
with memprof.remat.enable(budget=sys.argv[1], search_budgets=(0.0, 1.0)):
    print("inside:", functorch_config.activation_memory_budget, memprof.remat.active_mode(), flush=True)
    for _ in range(3):
        step(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
print("after:", functorch_config.activation_memory_budget, memprof.remat.active_mode())
'''


def _inside(out: str) -> tuple[float, str]:
    line = next(x for x in out.splitlines() if x.startswith("inside:"))
    _w, budget, mode = line.split()
    return float(budget), mode


@pytest.mark.slow
def test_a_budget_in_bytes_runs_the_planned_configuration(tmp_path: Path) -> None:
    """Under plain python, a limit nothing meets: the four configurations are predicted in other
    processes, the smallest runs with a warning (the choice among those that fit is `fit.plan`'s,
    tested with `trace --budget SIZE`), the block runs what the plan line names and says how to pin
    it, and the budget is undone after the block."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), "1kB"], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    budget, mode = _inside(res.stdout)
    plan_line = next(x for x in res.stderr.splitlines() if x.startswith("memprof: warning: memprof.remat.enable"))
    assert "nothing is predicted to fit; running the smallest" in plan_line
    assert f"budget {budget:g}" + (f" with --remat {mode}" if mode != "None" else " (stock)") in plan_line
    assert budget == 0.0  # the smaller of the two budgets searched
    pinned = ", ".join([*([repr(mode)] if mode != "None" else []), "budget=0"])
    assert f"without the search: memprof.remat.enable({pinned})" in res.stderr
    assert "after: 1.0 None" in res.stdout  # torch's default, restored


def test_a_ratio_is_set_as_it_is_and_memprofs_own_budget_is_kept(tmp_path: Path) -> None:
    import torch._functorch.config as functorch_config

    with memprof.remat.enable(budget="0.05"):  # a ratio: no search, set for the block and undone after it
        assert functorch_config.activation_memory_budget == 0.05 and memprof.remat.active_mode() is None
    with memprof.remat.enable("light", budget=0.2):
        assert functorch_config.activation_memory_budget == 0.2 and memprof.remat.active_mode() == "light"
    with memprof.remat.enable(budget=0):  # as the plan's warning prints it: the ratio 0, not 0 bytes
        assert functorch_config.activation_memory_budget == 0.0
    assert functorch_config.activation_memory_budget == 1.0 and memprof.remat.active_mode() is None
    # under `memprof trace --budget 0.3`, the script's own budget (even one in bytes) leaves memprof's
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, "-m", "memprof", "trace", "--budget", "0.3", "-o", "t.memprof",
                          str(script), "--", "100GB"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _inside(res.stdout) == (0.3, "None") and "predicting" not in res.stderr


def test_bad_budgets_and_a_script_that_cannot_be_started_again_are_one_line() -> None:
    from memprof.errors import MemprofError

    for bad in ("abc", "1.5", "0GB", -3, 24, 2.0, True):
        with pytest.raises(ValueError, match=r"budget|size"), memprof.remat.enable(budget=bad):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="unknown remat mode"), memprof.remat.enable("fast", budget=0.1):
        pass
    with pytest.raises(TypeError, match="needs a mode"), memprof.remat.enable():
        pass
    # pytest is not a script `python SCRIPT ARGS` starts again
    with pytest.raises(MemprofError, match="memprof fit SCRIPT --memory SIZE"), memprof.remat.enable(budget="24GB"):
        pass
