"""`memprof fit`: the configuration that fits under a limit, predicted with no training step and proved
by a run, end to end on the bundled Llama (CPU: the limit is on the CPU allocator's bytes); what it
says when nothing fits; and its choice and suggestions as pure functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memprof
from memprof.fit.plan import Candidate, Config, fitting, preference, smallest, suggestions

from ..conftest import ROOT, invoke_memprof, one_line_error, run_memprof

SCRIPT = str(ROOT / "examples" / "train_llama.py")


def _candidate(budget: float, remat: str | None, step: int, random_saved: bool = True) -> Candidate:
    return Candidate(Config(budget, remat), step, 1_000, 0, random_saved)


def test_the_choice_is_the_highest_budget_that_fits() -> None:
    cands = [_candidate(1.0, None, 900), _candidate(0.1, None, 500), _candidate(0.1, "light", 400),
             _candidate(0.05, None, 300), _candidate(0.0, "light", 200, random_saved=False)]
    assert [c.config for c in fitting(cands, 1_600)] == [Config(0.1, None), Config(0.1, "light"), Config(0.05)]
    assert [c.config for c in fitting(cands, 1_450)] == [Config(0.1, "light"), Config(0.05)]
    assert fitting(cands, 1_000) == []
    # a plan that redraws random ops in the backward never fits (wrong gradients), nor is it the smallest
    assert smallest(cands) == cands[3]
    assert sorted(cands, key=preference)[0].config == Config(1.0)


def test_a_predicted_reserved_peak_is_what_the_limit_applies_to() -> None:
    """On CUDA the limit applies to reserved bytes: a configuration whose allocator model reserves
    more than the limit does not fit, however little it allocates, and the smallest is the one that
    needs the least."""
    from dataclasses import replace

    high, low = replace(_candidate(1.0, None, 400), reserved=1_700), replace(_candidate(0.1, None, 500), reserved=1_550)
    assert (high.need, low.need) == (1_700, 1_550)
    assert [c.config for c in fitting([high, low], 1_600)] == [Config(0.1)]
    assert smallest([high, low]) == low
    assert _candidate(1.0, None, 400).need == 1_400  # (the CPU: no reserved bytes)


def test_what_would_close_the_gap_is_computed_from_the_bytes() -> None:
    found = suggestions(600, {"optimizer_state": 1_000, "parameter": 400, "gradient": 400},
                        [("fw0:logits", 2_000)], reserved_slack=0)
    saves = {s.what.split(":")[0]: s.saves for s in found}
    assert saves["the optimizer state is 1.0 kB at the peak"] == 750
    assert any("over 4 ranks" in s.what and s.saves == 750 for s in found)  # the fewest ranks closing 600 B
    assert any("FSDP over 2 ranks" in s.what and s.saves == 400 for s in found)
    assert found[0].saves == max(s.saves for s in found)
    assert any("fw0:logits" in s.what and s.saves == 1_000 for s in found)
    zeros = suggestions(600, {}, [], reserved_slack=0, zero_grads=900)
    assert [(s.saves, "returns only the loss" in s.what) for s in zeros] == [(900, True)]
    held = suggestions(600, {}, [], reserved_slack=0, held=(700, ["fw0:mm"]))
    assert [(s.saves, "fw0:mm" in s.what and "del logits" in s.what) for s in held] == [(700, True)]


def test_the_gpus_memory_is_a_child_processs_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a GPU is visible, `--memory device` and the check against the device's total ask a
    child process (what a run of the job sees, with no CUDA context held by `fit` itself); where the
    child cannot tell, the limit is an error and the total unknown, never the machine's RAM."""
    import memprof.fit as fit_mod

    monkeypatch.setattr(fit_mod, "visible_gpus", lambda: ["0"])
    for code, expected in (("print(1000, 8000)", ((1000, 8000), 1000, ("the GPU", 8000))),
                           ("raise SystemExit(1)", (None, None, None))):
        monkeypatch.setattr(fit_mod, "_GPU_MEMORY", code)
        fit_mod.gpu_memory.cache_clear()
        assert fit_mod.gpu_memory() == expected[0]
        assert fit_mod.device_total() == expected[2]
        if expected[1] is None:
            with pytest.raises(OSError, match="give --memory as a size"):
                fit_mod.device_limit()
        else:
            assert fit_mod.device_limit() == expected[1]
    fit_mod.gpu_memory.cache_clear()


def test_cuda_visible_devices_is_read_as_cuda_reads_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The devices before the first empty or negative entry: "-1" hides every GPU."""
    import memprof.sweep.runner as runner

    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(runner, "GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    for visible, gpus in (("1,0", ["1", "0"]), ("-1", []), ("0,-1,1", ["0"]), ("", []),
                          ("GPU-5a1f, 2", ["GPU-5a1f", "2"])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert runner.visible_gpus() == gpus, visible


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object], str]:
    out = tmp_path_factory.mktemp("fit") / "fit"
    res = run_memprof("fit", "--memory", "3.17MB", "--budgets", "0.0,1.0", "--jobs", "1", "-o", str(out),
                      "--json", SCRIPT, "--", "--steps", "4", cwd=out.parent)
    assert res.returncode == 0, res.stderr
    return out, json.loads(res.stdout), res.stderr


def test_a_limit_between_the_smallest_and_the_largest_is_met_and_proved(
        fitted: tuple[Path, dict[str, object], str]) -> None:
    out, doc, _err = fitted
    assert doc["fits"] is True and doc["limit_bytes"] == 3_170_000 and doc["device"] == "cpu"
    cands = doc["candidates"]
    assert isinstance(cands, list) and len(cands) == 4
    stock_1 = next(c for c in cands if c["budget"] == 1.0 and c["remat"] is None)
    assert stock_1["predicted_peak_bytes"] > 3_170_000  # the stock default would not fit: the choice matters
    choice = doc["choice"]
    assert isinstance(choice, dict) and choice["budget"] < 1.0
    # the proof: the verifying run's capture, its peak under the limit and within 1% of the prediction
    measured, predicted = doc["measured_peak_bytes"], doc["predicted_peak_bytes"]
    assert isinstance(measured, int) and isinstance(predicted, int)
    assert measured <= 3_170_000 and abs(predicted - measured) <= 0.01 * measured
    verified = doc["verified"]
    assert isinstance(verified, list)
    cap = memprof.load(out / verified[-1]["capture"])
    assert cap.peak("cpu") == measured
    assert doc["command"][:2] == ["memprof", "trace"] and "--budget" in doc["command"]
    assert json.loads((out / "fit.json").read_text()) == doc
    # beside memprof's answer, the usual ones: a parameter-count formula (the model's parameters, to
    # the byte; the capture's "parameter" category also holds the rotary embedding's 64-byte buffer)
    # and torch's default budget
    from ..conftest import load_example

    llama = load_example("llama")
    model, _ids = llama.build(llama.SMALL, "cpu")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert doc["parameter_bytes"] == params == 652_544
    assert doc["others"] == [
        {"what": "parameters x 4 (accelerate estimate-memory, Adam training)", "bytes": 4 * params},
        {"what": "torch's default budget (1.0, stock), predicted", "bytes": stock_1["predicted_peak_bytes"]}]


def test_another_limit_takes_the_earlier_predictions(fitted: tuple[Path, dict[str, object], str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`--predictions DIR`: another limit is tried with the predictions an earlier fit of the same
    command made, with no prediction process (the verifying run stands in here, as the other tests
    run it for real); any other command, or a configuration they lack, is refused in one line."""
    import memprof.fit as fit_mod
    from memprof.fit.plan import Measured

    out, doc, _err = fitted
    peaks = {(c["budget"], c["remat"]): c["predicted_peak_bytes"] for c in doc["candidates"]}  # type: ignore[union-attr]
    ran: list[Config] = []

    def verify(script: str, args: list[str], config: Config, *_a: object) -> Measured:
        ran.append(config)
        return Measured(config, peaks[(config.budget, config.remat)], None, None, None, 1.0, "run.memprof")

    monkeypatch.setattr(fit_mod, "_verify", verify)
    res = invoke_memprof("fit", "--memory", "3.6MB", "--budgets", "0.0,1.0", "--predictions", str(out), "-o", "again",
                         "--json", SCRIPT, "--", "--steps", "4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    again = json.loads(res.stdout)
    assert again["candidates"] == doc["candidates"] and ran == [Config(1.0)]
    assert again["choice"] == {"budget": 1.0, "remat": None} != doc["choice"]  # (the default fits 3.6 MB)
    assert json.loads((tmp_path / "again" / "search.json").read_text())["runs"] == json.loads(
        (out / "search.json").read_text())["runs"]
    assert not list((tmp_path / "again" / "logs").iterdir())  # (no prediction ran)
    for args, words in ((["--budgets", "0.0,0.5"], "no prediction for stock at 0.5, light at 0.5"),
                        (["--budgets", "0.0,1.0", SCRIPT, "--", "--steps", "3"], "made for `"),
                        (["--budgets", "0.0,1.0", "-o", str(out), "--force"], "which this fit replaces")):
        cmd = ["fit", "--memory", "3MB", "--predictions", str(out), *args]
        line = one_line_error(invoke_memprof(*cmd, *([] if SCRIPT in args else [SCRIPT, "--", "--steps", "4"]),
                                             cwd=tmp_path))
        assert words in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # (refused before anything is written)


def test_nothing_fits_says_by_how_much_and_what_would(fitted: tuple[Path, dict[str, object], str],
                                                      tmp_path: Path) -> None:
    """Under a limit below every prediction (the fixture's, taken again), the smallest configuration
    runs for real: the answer is how far over it is and what would close the gap, exit 1."""
    out, _doc, _err = fitted
    res = run_memprof("fit", "--memory", "2MB", "--budgets", "0.0,1.0", "--predictions", str(out),
                      "-o", str(tmp_path / "f"), SCRIPT, "--", "--steps", "4", cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    assert res.stdout.startswith("DOES NOT FIT") and " over" in res.stdout
    assert "optimizer state" in res.stdout and "8-bit" in res.stdout
    doc = json.loads((tmp_path / "f" / "fit.json").read_text())
    assert doc["fits"] is False and doc["choice"] is None and doc["suggestions"]
    assert doc["measured_peak_bytes"] > 2_000_000
    assert (doc["verified"][0]["budget"], doc["verified"][0]["remat"]) == (0.0, "light")  # (the smallest, run)


def test_a_scale_takes_each_values_predictions_where_they_are_whole(tmp_path: Path) -> None:
    """Under `--scale`, `--predictions` is an earlier scale fit's directory: a value's predictions
    of another command are refused up front; a value whose predictions lack a configuration asked
    for (a probe that predicted the smallest alone) is predicted anew, not refused."""
    from memprof.fit.search import check_predictions, reused
    from memprof.sweep.result import Run, Sweep

    def saved(value: int, budgets: list[float], variants: list[str], args: tuple[str, ...] = ("--steps", "3")) -> None:
        sub = tmp_path / f"scale-{value}"
        sub.mkdir()
        runs = [Run(v, b, "completed", 0, None, None, "log", 1.0) for v in variants for b in budgets]
        Sweep([SCRIPT, *args, f"--batch={value}"], budgets, variants, runs, mode="predict").save(sub)
        (sub / "sweep.json").replace(sub / "search.json")

    saved(4, [0.0, 1.0], ["stock", "light"])
    saved(8, [0.0], ["stock", "light"])  # (a narrowed probe)
    check_predictions(tmp_path, SCRIPT, ["--steps", "3"], [0.0, 1.0], ["light"], "--batch={}", [2, 4, 8])
    assert reused(tmp_path / "scale-4", SCRIPT, ["--steps", "3", "--batch=4"], [0.0, 1.0], ["stock", "light"])
    assert reused(tmp_path / "scale-8", SCRIPT, ["--steps", "3", "--batch=8"], [0.0, 1.0], ["stock", "light"],
                  strict=False) is None
    with pytest.raises(memprof.MemprofError, match="made for `"):
        check_predictions(tmp_path, SCRIPT, ["--steps", "4"], [0.0, 1.0], ["light"], "--batch={}", [2, 4, 8])
    with pytest.raises(memprof.MemprofError, match="no scale-N directory"):
        check_predictions(tmp_path, SCRIPT, ["--steps", "3"], [0.0, 1.0], ["light"], "--batch={}", [16, 32])


@pytest.mark.parametrize("args, message", [
    (["--memory", "lots"], "--memory: 'lots' is not a size"),
    (["--memory", "0GB"], "--memory must be more than 0 bytes"),
    (["--memory", "24"], "--memory: '24' has no unit: write 24GB, 24GiB or 24MB (24B for bytes)"),
    (["--memory", "999TB"], "total memory ("),  # (the machine's, or the GPU's: no run could prove it)
    (["--memory", "1GB", "--budgets", "2"], "outside [0, 1]"),
])
def test_bad_input_is_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    line = one_line_error(invoke_memprof("fit", *args, SCRIPT, cwd=tmp_path))
    assert message in line
    assert not list(tmp_path.iterdir())


def test_a_budget_in_bytes_plans_the_configuration_that_fits(fitted: tuple[Path, dict[str, object], str],
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`trace --budget SIZE`'s plan: the configuration `fit` chooses, from the same predictions (the
    fixture's, taken as `--predictions` takes them: the search itself is the fixture's to run)."""
    import functools

    import memprof.fit as fit_mod
    from memprof.cli.options import Budget

    assert Budget().convert("24GB", None, None) == 24 * 10**9 and Budget().convert("0.1", None, None) == 0.1
    assert Budget().convert("1.5GiB", None, None) == 3 * 2**29
    out, doc, _err = fitted
    monkeypatch.setattr(fit_mod, "predicted", functools.partial(fit_mod.predicted, reuse=out))
    # the bundled Llama: stock at 0 and 1 and light at 1 are predicted above 3.17 MB, light at 0 under it
    assert fit_mod.plan(SCRIPT, ["--steps", "4"], 3_170_000, budgets=(0.0, 1.0)) == Config(0.0, "light")
    assert doc["choice"] == {"budget": 0.0, "remat": "light"}
    # under every prediction, the smallest runs (with a warning saying by how much it is over)
    assert fit_mod.plan(SCRIPT, ["--steps", "4"], 1_000_000, budgets=(0.0, 1.0)) == Config(0.0, "light")
    for bad, words in (("0GB", "more than 0 bytes"), ("3parsecs", "unknown unit"), ("1.5", "in [0, 1]")):
        assert words in one_line_error(invoke_memprof("trace", "--budget", bad, SCRIPT, cwd=tmp_path))


def test_a_run_over_in_reserved_bytes_rules_out_the_next_ones_over_by_as_much() -> None:
    """The search predicts allocated bytes; the first run measured the caching allocator's reserved
    bytes above them. The next run is the preferred configuration that fits with that overhead, not
    the next in line that would be refused as well (GPT-2 at 5 GB: three runs over, then one under)."""
    from memprof.fit.plan import FitResult, Measured, next_to_verify
    from memprof.fit.report import format_fit

    cands = [_candidate(0.2, None, 3_800), _candidate(0.2, "light", 3_700), _candidate(0.1, None, 3_600),
             _candidate(0.05, "light", 3_300), _candidate(0.0, "light", 3_000)]
    limit = 5_000
    assert next_to_verify(cands, limit, [], set()) == cands[0]
    first = Measured(Config(0.2), 4_800, 5_400, 3_800, 1_000, 10.0, "verify-1.memprof")
    ran = {Config(0.2)}
    assert next_to_verify(cands, limit, [first], ran) == cands[3]  # 600 B of overhead: 4,300 + 600 fits
    assert next_to_verify(cands, limit, [first], {*ran, Config(0.05, "light")}) == cands[4]
    broken = Measured(Config(0.2), 4_800, 9_000, 3_800, 1_000, None, "x", error="out of memory")
    assert next_to_verify(cands, limit, [broken], ran) == cands[1]  # a failed run measured no overhead
    second = Measured(Config(0.05, "light"), 4_300, 4_900, 3_300, 1_000, 11.0, "verify-2.memprof")
    text = format_fit(FitResult(limit, "cuda", cands, [first, second], choice=second))
    assert "FITS: budget 0.05 with --remat light" in text
    assert "not run: 2 preferred configuration(s)" in text and "within 600 B of it" in text


def test_a_run_over_only_by_garbage_says_so() -> None:
    """A verifying run whose peak held tensors in reference cycles (the compiling step's outputs, say,
    freed later by Python's collector) says how much, and whether the run is under the limit without
    them: the prediction was right, the collector's timing was not."""
    from memprof.fit.plan import FitResult, Measured
    from memprof.fit.report import fit_json, format_fit

    cands = [_candidate(1.0, None, 3_000)]
    over = Measured(Config(1.0), 4_500, None, 3_500, 1_000, 1.0, "verify-1.memprof", garbage=600)
    result = FitResult(4_200, "cpu", cands, [over])
    text = format_fit(result)
    assert "DOES NOT FIT" in text
    assert "600 B (600 B) live at the peak was garbage in reference cycles" in text
    assert "(without it the run is under the limit): gc.collect() after the first step" in text
    assert "the prediction leaves it out: +100 B from the rest" in text  # (4,000 predicted; 4,500 less 600 ran)
    assert fit_json(result)["verified"][0]["garbage_bytes"] == 600
    too_much = Measured(Config(1.0), 5_000, None, 4_000, 1_000, 1.0, "verify-1.memprof", garbage=600)
    assert "without it" not in format_fit(FitResult(4_200, "cpu", cands, [too_much]))
    assert "garbage" not in format_fit(FitResult(4_200, "cpu", cands, [Measured(Config(1.0), 4_500, None, 3_500,
                                                                                 1_000, 1.0, "v.memprof")]))


def test_scale_steps_down_when_the_answers_run_is_over_the_limit(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The bisection's answer is a prediction of allocated bytes; its run can exceed the limit in
    reserved bytes. Then the next configuration with room for the measured overhead runs, and where
    none is left, the next value down (predicted first if the bisection never probed it)."""
    import memprof.fit as fit_mod
    from memprof.fit.plan import Measured
    from memprof.fit.report import format_scale, scale_json

    searched: list[tuple[int, list[float], list[str]]] = []

    def predicted(script: str, args: list[str], budgets: list[float], modes: list[str], *_a: object) -> fit_mod.Search:
        n = int(args[-1].split("=")[1])  # the batch: 100 B of step per sample, over 1,000 resident
        searched.append((n, list(budgets), list(modes)))
        return fit_mod.Search([Candidate(Config(1.0), 100 * n, 1_000), Candidate(Config(0.0, "light"), 60 * n, 1_000)],
                              "cuda", None, True, None)

    runs: list[tuple[int, Config]] = []

    def verify(script: str, args: list[str], config: Config, *_a: object) -> Measured:
        n = int(args[-1].split("=")[1])
        runs.append((n, config))
        step = (100 if config.remat is None else 60) * n
        return Measured(config, 1_000 + step, 1_000 + step + 500, step, 1_000, 1.0, f"run{len(runs)}.memprof")

    monkeypatch.setattr(fit_mod, "predicted", predicted)
    monkeypatch.setattr(fit_mod, "_verify", verify)
    r = fit_mod.fit_scale("train.py", [], "--batch={}", [4, 8, 16, 32, 64], 3_000, [0.0, 1.0], ["light"], tmp_path)
    # predicted: batch 32 fits light (2,920), 64 does not; each run has 500 B of reserved overhead:
    # 32 at light runs over (3,420) and no other configuration at 32 fits; at 16, stock (2,600) has
    # no room for the 500 B, light (1,960) has: it runs, under the limit
    assert runs == [(32, Config(0.0, "light")), (16, Config(0.0, "light"))]
    # every configuration at the first probe (16); the other probes its smallest (light at 0, beside
    # stock at 0); the answer (32) again in whole
    assert searched == [(16, [0.0, 1.0], ["light"]), (32, [0.0], ["light"]), (64, [0.0], ["light"]),
                        (32, [0.0, 1.0], ["light"])]
    assert r.fits and r.answer is not None and r.answer.value == 16 and r.measured is not None
    assert [v for v, _m in r.over] == [32]
    text = format_scale(r, ["train.py"])
    assert text.startswith("FITS: --batch=16 at budget 0 with --remat light")
    assert "run at 32 (budget 0 with --remat light): 3.4 kB, over the limit" in text
    assert "the next value, 32, ran over the limit" in text
    assert [o["value"] for o in scale_json(r)["runs_over_limit"]] == [32]


def test_scale_runs_the_next_value_its_reserved_prediction_alone_ruled_out(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocator model's reserved bytes can be high (the GQA decoder at batch 8: +10.8%). Above
    the answer, a value whose smallest configuration fits in allocated bytes with the overhead the
    answer's run measured, but not by the model's reserved bytes, runs too, and is the answer if its
    run stays under the limit."""
    import memprof.fit as fit_mod
    from memprof.fit.plan import Measured
    from memprof.fit.report import format_scale

    def predicted(script: str, args: list[str], budgets: list[float], modes: list[str], *_a: object) -> fit_mod.Search:
        n = int(args[-1].split("=")[1])  # the model reserves 800 B above the allocated peak
        return fit_mod.Search([Candidate(Config(1.0), 100 * n, 1_000, reserved=1_800 + 100 * n),
                               Candidate(Config(0.0, "light"), 50 * n, 1_000, reserved=1_800 + 50 * n)],
                              "cuda", None, True, None)

    runs: list[tuple[int, Config]] = []
    overhead = {32: 200}

    def verify(script: str, args: list[str], config: Config, *_a: object) -> Measured:
        n = int(args[-1].split("=")[1])
        runs.append((n, config))
        step = (100 if config.remat is None else 50) * n
        return Measured(config, 1_000 + step, 1_000 + step + overhead.get(n, 200), step, 1_000, 1.0,
                        f"run{len(runs)}.memprof")

    monkeypatch.setattr(fit_mod, "predicted", predicted)
    monkeypatch.setattr(fit_mod, "_verify", verify)
    r = fit_mod.fit_scale("train.py", [], "--batch={}", [4, 8, 16, 32, 64], 3_000, [0.0, 1.0], ["light"], tmp_path)
    # predicted: 16 fits (light, 2,600 reserved), 32 does not (3,400 reserved, 2,600 allocated); the
    # run at 16 reserved 200 B above its peak, so 32 has room (2,800): it runs, under the limit
    assert runs == [(16, Config(0.0, "light")), (32, Config(0.0, "light"))]
    assert r.fits and r.answer is not None and r.answer.value == 32 and r.measured is not None
    assert r.measured.reserved_peak == 2_800 and not r.over
    assert format_scale(r, ["train.py"]).startswith("FITS: --batch=32 at budget 0 with --remat light")
    # a run there over the limit leaves the answer where it was, and says why it ran
    runs.clear()
    overhead[32] = 500
    r = fit_mod.fit_scale("train.py", [], "--batch={}", [4, 8, 16, 32, 64], 3_000, [0.0, 1.0], ["light"], tmp_path)
    assert runs == [(16, Config(0.0, "light")), (32, Config(0.0, "light"))]
    assert r.answer is not None and r.answer.value == 16 and r.fits and [v for v, _m in r.over] == [32]
    assert "run at 32 (budget 0 with --remat light): 3.1 kB, over the limit: run as well" in format_scale(r, ["t.py"])


def test_a_script_that_compiles_nothing_is_measured_as_it_is(tmp_path: Path) -> None:
    """No graph with a backward is compiled: no budget or remat mode applies. `fit` says so and runs
    the script as it is (exit 1 over the limit, with what would close the gap); `fit --scale` runs
    each value it probes as it is; `trace --budget SIZE` refuses in one line. (Past the first fit,
    stock alone is searched: a remat mode's prediction of a script that compiles nothing is the
    first fit's to show.)"""
    script = tmp_path / "eager.py"
    script.write_text("import torch\nm = torch.nn.Linear(64, 64)\nopt = torch.optim.AdamW(m.parameters())\n"
                      "for _ in range(3):\n    m(torch.randn(8, 64)).sum().backward(); opt.step(); opt.zero_grad()\n")
    res = run_memprof("fit", "--memory", "10kB", "--budgets", "1.0", "-o", "out", "--json", str(script), cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    assert doc["compiled"] is False and doc["fits"] is False and doc["choice"] is None
    cap = memprof.load(tmp_path / "out" / doc["verified"][0]["capture"])
    assert doc["measured_peak_bytes"] == cap.peak("cpu") > 10_000
    assert any("optimizer state" in s["what"] for s in doc["suggestions"])
    # a script that fails before it gets that far is said to, with its own message
    failing = tmp_path / "fails.py"
    failing.write_text('raise SystemExit("no data at /data/train")\n')
    stock = ("--budgets", "1.0", "--remat", "off")
    res = run_memprof("fit", "--memory", "10kB", *stock, "-o", "out2", str(failing), cwd=tmp_path)
    assert res.returncode == 1 and res.stdout.startswith(
        "NOT MEASURED: the script ended before any compiled graph's backward (exit): no data at /data/train")
    # --scale: each value probed runs as it is, the largest under the limit is the answer, proved by its run
    scaled = tmp_path / "scaled.py"
    scaled.write_text("import sys, torch\nm = torch.nn.Linear(256, 256)\nbatch = int(sys.argv[1])\n"
                      "for _ in range(2):\n    m(torch.randn(batch, 256)).sum().backward()\n")
    res = run_memprof("fit", "--memory", "3MB", "--scale", "{}", "8,4096", *stock, "-o", "out3",
                      "--json", str(scaled), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["compiled"] is False and doc["fits"] is True and doc["value"] == 8 and doc["choice"] is None
    assert [(p["value"], p["fits"]) for p in doc["probes"]] == [(8, True), (4096, False)]
    for p in doc["probes"]:
        assert p["measured_peak_bytes"] == memprof.load(tmp_path / "out3" / p["capture"]).peak("cpu")
    assert doc["measured_peak_bytes"] == doc["probes"][0]["measured_peak_bytes"] <= 3_000_000
    assert doc["probes"][1]["measured_peak_bytes"] > 3_000_000  # (its input alone is 4 MiB)
    res = run_memprof("fit", "--memory", "3MB", "--scale", "{}", "8,64", *stock, "-o", "out4",
                      str(failing), cwd=tmp_path)
    assert res.returncode == 1 and res.stdout.startswith(
        "NOT MEASURED: the script ended before any compiled graph's backward (exit): no data at /data/train")
    res = invoke_memprof("trace", "--budget", "1GB", "-o", "t.memprof", str(script), cwd=tmp_path)
    *said, line = res.stderr.strip().splitlines()  # (the search's one line of progress, then the error)
    assert res.returncode != 0 and "Traceback" not in res.stderr and len(said) == 1
    assert line.startswith("memprof: error:") and "compiles no graph with a backward" in line
