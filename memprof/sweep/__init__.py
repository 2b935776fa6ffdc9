"""Budget sweeps: measure the step peak at many `activation_memory_budget`s, one process each,
flag where less budget gives more memory, and explain each flag from the captures and plans.

    from memprof.sweep import parse_budgets, run_sweep, load_sweep
    sweep = run_sweep("train.py", [], parse_budgets("0.05:0.30:0.05"), ["stock"], Path("out"), jobs=4)
    sweep.flags("stock"), sweep.diagnoses("stock")
"""

from __future__ import annotations

from memprof.sweep.detect import Flag, non_monotone, spearman, worst_per_budget
from memprof.sweep.manifest import prepare_dir
from memprof.sweep.result import Diagnosis, Run, Sweep, load_sweep
from memprof.sweep.runner import run_sweep
from memprof.sweep.spec import parse_budgets

__all__ = ["Diagnosis", "Flag", "Run", "Sweep", "load_sweep", "non_monotone", "parse_budgets", "prepare_dir",
           "run_sweep", "spearman", "worst_per_budget"]
