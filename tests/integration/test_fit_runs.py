"""`memprof fit --scale` end to end (the largest batch that fits), on the bundled Llama on the CPU,
stock budgets only to keep it short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memprof
from memprof.fit.plan import Candidate, Config

from ..conftest import ROOT, run_memprof

SCRIPT = str(ROOT / "examples" / "train_llama.py")


def test_the_largest_batch_that_fits(tmp_path: Path) -> None:
    from memprof.fit.scale import bisect, parse_scale

    assert parse_scale("--batch={}", "8:64") == [8, 16, 32, 64] and parse_scale("--b {}", "1:7:3") == [1, 4, 7]
    assert parse_scale("--b={}", "3,1,2") == [1, 2, 3]
    for template, spec in (("--batch", "1:4"), ("--b={}", "4:2"), ("--b={}", "0,1"), ("--b={}", "a:b")):
        with pytest.raises(memprof.MemprofError):
            parse_scale(template, spec)
    # bisection over a peak that grows with the value: the largest value under the limit, few probes
    probes = bisect(list(range(1, 101)), lambda v: [Candidate(Config(1.0), 100 * v, 1_000)], 1_000 + 100 * 37)
    assert max(p.value for p in probes if p.choice is not None) == 37 and len(probes) <= 7
    res = run_memprof("fit", "--memory", "5MB", "--scale", "--batch={}", "1:16", "--budgets", "1.0", "--remat", "off",
                      "--jobs", "1", "-o", str(tmp_path / "s"), "--json", SCRIPT, "--", "--steps", "3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["fits"] is True and doc["value"] in (1, 2, 4, 8)
    over = [p for p in doc["probes"] if p["value"] > doc["value"]]
    assert over and all(not p["fits"] and p["predicted_peak_bytes"] > 5_000_000 for p in over)
    assert doc["measured_peak_bytes"] <= 5_000_000
    assert abs(doc["predicted_peak_bytes"] - doc["measured_peak_bytes"]) <= 0.01 * doc["measured_peak_bytes"]
