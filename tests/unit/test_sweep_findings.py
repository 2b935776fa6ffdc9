"""What `memprof sweep` prints after its table, on sweeps built from plain data (no run): a noise
floor scaled to the peaks, lines that say something, and the flags it explains."""

from __future__ import annotations

from memprof.sweep.measure import Measured
from memprof.sweep.result import Run, Sweep
from memprof.sweep.table import render_findings


def _run(budget: float, peak: int, estimates: dict[str, float | None] | None = None) -> Run:
    m = Measured(device="cpu", peak=peak, step_peak=peak, step_peaks=[peak], step_ms=8.0, steps=3,
                 step_source="markers", compiled=True, plans=1, facts=None, estimates=dict(estimates or {}))
    return Run("stock", budget, "completed", 0, None, None, "", 1.0, m)


def _sweep(peaks: dict[float, int], abs_bytes: float | None = None, **est: dict[float, float | None]) -> Sweep:
    runs = [_run(b, p, {name: e[b] for name, e in est.items()}) for b, p in peaks.items()]
    return Sweep(command=["s.py"], budgets=list(peaks), variants=["stock"], runs=runs,
                 noise={"abs_bytes": abs_bytes, "rel": 0.005})


def test_the_noise_floor_scales_with_small_peaks() -> None:
    """The bundled example on a 2-core CPU: 0.80 MB at budget 0 against 0.60 MB at 0.1 (+34%). A fixed
    1.5 MB floor hid it and said "less budget never gives more memory"; scaled to 2% of the smallest
    peak it is flagged, and a floor the user sets that hides every difference says so."""
    peaks = {0.0: 800_000, 0.1: 600_000, 1.0: 900_000}
    auto = _sweep(peaks)
    assert auto.abs_tol() == 12_000 and [(f.low, f.high) for f in auto.flags()] == [(0.0, 0.1)]
    assert "less budget, more memory at 1 pair(s) of budgets (noise: max(12.0 kB (2% of the smallest peak" \
        in render_findings(auto)
    fixed = _sweep(peaks, abs_bytes=1.5e6)
    assert fixed.flags() == [] and fixed.floor_hides()
    text = render_findings(fixed)
    assert "the noise floor exceeds every difference between these 3 budgets' peaks" in text
    assert "less budget never gives more memory" not in text
    # large peaks keep the 1.5 MB floor (one plan's spread across processes on the H200: 2.5 MB of 190 MB)
    assert _sweep({0.0: 190_000_000, 1.0: 400_000_000}).abs_tol() == 1_500_000


def test_lines_that_say_nothing_are_left_out() -> None:
    peaks = {0.0: 800_000, 0.1: 600_000, 1.0: 900_000}
    same = {0.0: 700_000.0, 0.1: 610_000.0, 1.0: 880_000.0}
    text = render_findings(_sweep(peaks, memprof=same, inductor=same, **{"inductor (outputs kept)": same},
                                  **{"knapsack evaluator": {0.0: None, 0.1: None, 1.0: 5.0}}))
    assert "stock: memprof estimate vs measured over 3 budgets: Spearman" in text
    assert "stock: inductor estimate vs measured" in text
    assert "outputs kept" not in text  # the same figures as Inductor's line
    assert "knapsack" not in text  # one budget: no Spearman, and its units are not bytes


def test_the_count_says_which_pairs_are_explained() -> None:
    """Three flagged pairs, two lower budgets: each lower budget's worst pair is explained, and the
    line says so."""
    s = _sweep({0.0: 5_000_000, 0.05: 4_000_000, 0.1: 3_000_000, 1.0: 6_000_000})
    assert len(s.flags()) == 3 and len(s.diagnoses()) == 2
    assert "at 3 pair(s) of budgets (noise: max(60.0 kB (2% of the smallest peak, at most 1.5 MB), 0.5%)); " \
           "for each lower budget, the pair it exceeds most:" in render_findings(s)


def test_the_allocators_unsplit_blocks_are_named_and_taken_out_of_the_error() -> None:
    """The GQA decoder on the H200 (stock, budget 0.05): 3,090,277,376 B measured, 3,042,042,880 B
    estimated in requests (-1.56%); 48,234,496 B of the peak were blocks larger than their requests
    (41 requests of 2 MiB given 3 MiB blocks). A prediction (no allocator state to replay from) says
    so and scores the requests; a measured sweep's estimate counts the blocks and says that instead."""
    s = _sweep({0.05: 3_090_277_376}, memprof={0.05: 3_042_042_880.0})
    assert s.runs[0].measured is not None
    s.runs[0].measured.block_slack = 48_234_496
    text = render_findings(s)
    assert "median error 1.6%" in text
    assert ("the caching allocator's blocks held 48.2 MB (median; up to 48.2 MB) more than the requests at the "
            "measured peaks (large blocks it did not split); memprof's estimate counts requests here; against "
            "the requests (peak less those bytes) its median error is 0.0%, max 0.0%") in text
    assert "caching allocator" not in render_findings(_sweep({0.05: 1000}, memprof={0.05: 990.0}))
    blocks = _sweep({0.05: 3_090_277_376}, memprof={0.05: 3_090_277_376.0})
    assert blocks.runs[0].measured is not None
    blocks.runs[0].measured.block_slack, blocks.runs[0].measured.estimate_blocks = 48_234_496, True
    text = render_findings(blocks)
    assert "median error 0.0%" in text and "memprof's estimate counts them, replaying the step's requests" in text


def test_the_table_says_where_the_estimate_cannot_count_what_graph_calls_allocated() -> None:
    """A run whose compiled-graph calls allocated what their wrapper code does not show (the CPU's
    bf16 matrix multiplies): where the estimate is off by more than 0.5%, its row says why; where it
    is right (fallback kernels whose scratch the probes count), nothing."""
    import dataclasses

    from memprof.sweep.table import render_table

    s = _sweep({0.0: 6_900_000, 1.0: 6_900_000}, memprof={0.0: 3_200_000.0, 1.0: 6_900_000.0})
    for r in s.runs:
        assert r.measured is not None
        r.measured = dataclasses.replace(r.measured, unseen_calls=6)
    rows = {line.split("|")[1].strip(): line for line in render_table(s).splitlines()[2:]}
    assert "est: 6 graph calls allocated what their wrapper code does not show" in rows["0"]
    assert "wrapper code" not in rows["1"]
