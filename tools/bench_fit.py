"""`memprof fit` on one bundled model at three limits, and `--scale` proved one value up: the figures of
the fit issue, from one command.

    python tools/bench_fit.py --model gqa --full --budgets 0.0,0.05,0.1,0.3,1.0
    python tools/bench_fit.py --model gpt2 --full --scale 4,8,12,16,24      # the values of --batch={}
    python tools/bench_fit.py --model llama --budgets 0.0,1.0 --jobs 1               # CPU, small

1. A search: `memprof fit --memory device` (every configuration predicted, the preferred one run).
2. Three limits from its predictions (the most each configuration needs: allocated, and reserved on
   CUDA): halfway between the smallest and torch's default (budget 1.0, stock), 3% above the
   smallest, 5% below it. The three fits take the search's predictions (`--predictions`) and run
   side by side: each costs its verifying runs alone.
3. With `--scale`: `memprof fit --scale` under the first limit (or `--scale-limit SIZE`, which skips
   the search and the limits: the scale alone), then the value after its answer run
   for real at the configuration that needs the least there (`memprof trace`): it must go over the
   limit (or run out of memory) for the answer to be the largest.

With `--timing ROUNDS`, every configuration of the search is also timed (tools/bench_remat.py) and
each limit's choice is set beside the fastest configuration predicted to fit it.
Prints the limits' table (and writes `--json`) before the scale runs, and again with the scale's
line last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_memprof(*args: str, cwd: Path) -> tuple[int, float, str]:
    """(exit status, seconds, stderr's last lines) of one `memprof` command."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memprof", *args], cwd=cwd, capture_output=True, text=True)
    return proc.returncode, time.perf_counter() - t0, "\n".join(proc.stderr.splitlines()[-3:])


def need(c: dict[str, Any]) -> int:
    return max(int(c["predicted_peak_bytes"]), int(c["predicted_reserved_bytes"] or 0))


def choosable(search: dict[str, Any]) -> list[dict[str, Any]]:
    """The search's configurations `fit` can choose: predicted, and drawing no random op anew."""
    return [c for c in search["candidates"] if c["predicted_peak_bytes"] and c["random_ops_saved"]]


def limits(search: dict[str, Any]) -> list[tuple[str, int]]:
    """The three limits of the issue, from the search's predictions."""
    cands = choosable(search)
    best = min(need(c) for c in cands)
    default = next((need(c) for c in cands if c["budget"] == 1.0 and c["remat"] is None), None)
    out = [("3% above the smallest", int(best * 1.03)), ("5% below the smallest", int(best * 0.95))]
    if default is not None and default > best * 1.06:
        out.insert(0, ("halfway to the default", (best + default) // 2))
    return out


def categories(fit_dir: Path, predictions: Path) -> dict[str, Any] | None:
    """What the last verified configuration held at its run's peak by category (the whole process),
    beside what its prediction held at the predicted peak (the step's own bytes by category, the
    resident bytes as one figure): where a prediction is off, the category that differs says why."""
    doc = json.loads((fit_dir / "fit.json").read_text())
    if not doc.get("verified"):
        return None
    last = doc["verified"][-1]
    run = json.loads((fit_dir / f"verify-{len(doc['verified'])}.json").read_text())["runs"][0]["measured"]
    variant = last["remat"] or "stock"
    predicted = next((r["measured"] for r in json.loads((predictions / "search.json").read_text())["runs"]
                      if r["budget"] == last["budget"] and r["variant"] == variant and r["measured"]), None)
    if run is None or predicted is None:
        return None
    return {"config": f"{last['budget']:g} {variant}", "predicted_step": predicted["at_peak"] or {},
            "predicted_resident": predicted["resident"], "measured": run["at_peak"] or {},
            "measured_resident": run["resident"]}


def row(what: str, doc: dict[str, Any], seconds: float, fit_dir: Path, predictions: Path) -> dict[str, Any]:
    choice = doc["choice"]
    measured, predicted = doc["measured_peak_bytes"], doc["predicted_peak_bytes"]
    error = (predicted - measured) / measured if measured and predicted else None
    verified = doc.get("verified", [])
    return {"limit": what, "limit_bytes": doc["limit_bytes"], "fits": doc["fits"],
            "choice": f"{choice['budget']:g} {choice['remat'] or 'stock'}" if choice else None,
            "predicted_bytes": predicted, "measured_bytes": measured, "error": error,
            "reserved_bytes": doc.get("measured_reserved_bytes"), "runs": len(verified),
            "predicted_reserved": next((c["predicted_reserved_bytes"] for c in doc["candidates"]
                                        if choice and c["budget"] == choice["budget"]
                                        and c["remat"] == choice["remat"]), None),
            "seconds": round(seconds, 1), "categories": categories(fit_dir, predictions)}


def next_up(scaled: dict[str, Any], template: str, values: list[int], script: list[str], out: Path,
            cwd: Path) -> dict[str, Any] | None:
    """The value after the answer, run at the configuration its probe needs least with (the
    smallest), or at the answer's: whether it went over the limit."""
    import memprof
    from memprof.fit.scale import with_value

    if scaled["value"] is None or scaled["value"] == values[-1]:
        return None
    value = values[values.index(scaled["value"]) + 1]
    probe = next((p for p in scaled["probes"] if p["value"] == value and p.get("budget") is not None), None)
    config = probe or scaled["choice"]
    options = ["--budget", repr(config["budget"])] + (["--remat", config["remat"]] if config["remat"] else [])
    cap_path = out / f"next-{value}.memprof"
    rc, seconds, err = run_memprof("trace", *options, "-o", str(cap_path), "--force", "--", script[0],
                               *with_value(script[1:], template, value), cwd=cwd)
    cap = memprof.load(cap_path)
    dev = cap.main_device
    tl = cap.timeline(dev)
    peak = cap.peak(dev, lower_bound=True)
    reserved = tl.reserved_peak if tl.has_reserved else None
    used = max(peak, reserved or 0)
    oom = cap.meta.get("status") == "oom"
    return {"value": value, "config": f"{config['budget']:g} {config['remat'] or 'stock'}", "peak_bytes": peak,
            "reserved_bytes": reserved, "oom": oom, "over": oom or used > scaled["limit_bytes"],
            "exit": rc, "seconds": round(seconds, 1), "stderr": err if rc and not oom else ""}


def timing(a: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Every configuration of the search timed by tools/bench_remat.py (its forward and backward, the
    same for every configuration; compiled side by side, timed one process at a time in rotating
    rounds): for "no configuration that fits is more than 5% faster than the choice"."""
    out = tmp / "timing.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_remat.py"), "--model", a.model, *(["--paper"] if a.full else []),
           "--budgets", a.budgets, "--modes", "light", "--rounds", str(a.timing), "--steps", "5", "--json", str(out),
           *(["--jobs", str(a.jobs)] if a.jobs else [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
    print(f"timing: {time.perf_counter() - t0:.0f} s, exit {proc.returncode}", flush=True)
    return json.loads(out.read_text()) if out.exists() else []


def fastest_fitting(r: dict[str, Any], search: dict[str, Any], times: list[dict[str, Any]]) -> None:
    """Beside a limit's row: the choice's step time and the fastest configuration predicted to fit."""
    ms = {(t["budget"], None if t["variant"] == "stock" else t["variant"]): t.get("step_ms") for t in times}
    fitting = [(ms.get((c["budget"], c["remat"])), f"{c['budget']:g} {c['remat'] or 'stock'}")
               for c in choosable(search) if need(c) <= r["limit_bytes"]]
    timed = sorted((t, name) for t, name in fitting if t is not None)
    chosen = next((t for t, name in fitting if name == r["choice"]), None)
    r["chosen_ms"] = chosen
    r["fastest_fitting"] = {"config": timed[0][1], "ms": timed[0][0]} if timed else None


def _n(value: int | None) -> str:
    return f"{value:,}" if value is not None else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=["llama", "bert", "gpt2", "gqa", "vit"])
    ap.add_argument("--full", action="store_true", help="the model's full size (--full / --paper)")
    ap.add_argument("--budgets", default="0.0,0.05,0.1,0.3,1.0")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=None, help="predicting processes (default: fit's)")
    ap.add_argument("--scale", metavar="VALUES", default=None, help="fit --scale's values (A:B, A:B:STEP, a,b,c)")
    ap.add_argument("--scale-arg", default="--batch={}", help="the script argument they go in (--scale-arg=...)")
    ap.add_argument("--scale-limit", metavar="SIZE", default=None,
                    help="the scale's limit (24GB, 8000MB): the scale alone, without the search and limits")
    ap.add_argument("--layers", type=int, default=None, help="the script's --layers (fewer compile sooner)")
    ap.add_argument("--timing", type=int, metavar="ROUNDS", default=0,
                    help="also time every configuration (tools/bench_remat.py, this many rounds)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    script = [str(ROOT / "examples" / f"train_{a.model}.py"), *(["--paper"] if a.full else []),
              *(["--layers", str(a.layers)] if a.layers else []), "--steps", str(a.steps)]
    common = ["--budgets", a.budgets, *(["--jobs", str(a.jobs)] if a.jobs else []), "--json"]
    tmp = Path(tempfile.mkdtemp(prefix="bench_fit_"))
    if a.scale and a.scale_limit:
        from memprof.analysis.units import parse_size

        scale(a, script, common, parse_size(a.scale_limit), [], tmp)
        return
    rc, seconds, err = run_memprof("fit", "--memory", "device", "-o", str(tmp / "search"), *common, script[0], "--",
                               *script[1:], cwd=tmp)
    search = json.loads((tmp / "search" / "fit.json").read_text())
    rows = [row("the device (search)", search, seconds, tmp / "search", tmp / "search")]
    print(f"search: {seconds:.0f} s, exit {rc} {err}", flush=True)

    def one(item: tuple[int, tuple[str, int]]) -> dict[str, Any]:
        i, (what, limit) = item
        rc, seconds, err = run_memprof("fit", "--memory", f"{limit}B", "-o", str(tmp / f"limit{i}"), "--predictions",
                                   str(tmp / "search"), *common, script[0], "--", *script[1:], cwd=tmp)
        print(f"{what}: {seconds:.0f} s, exit {rc} {err}", flush=True)
        return row(what, json.loads((tmp / f"limit{i}" / "fit.json").read_text()), seconds, tmp / f"limit{i}",
                   tmp / "search")

    chosen = limits(search)
    with ThreadPoolExecutor(len(chosen)) as pool:
        rows += list(pool.map(one, enumerate(chosen)))
    if a.timing:
        times = timing(a, tmp)
        for r in rows:
            fastest_fitting(r, search, times)
    # the limits' table first: a scale that runs out of time leaves it printed and written
    report(a, rows, None, tmp)
    if a.scale:
        scale(a, script, common, chosen[0][1], rows, tmp)


def scale(a: argparse.Namespace, script: list[str], common: list[str], limit: int, rows: list[dict[str, Any]],
          tmp: Path) -> None:
    """`fit --scale` under `limit`, then the value after its answer run for real; the tables again."""
    from memprof.fit.scale import parse_scale

    values = parse_scale(a.scale_arg, a.scale)
    rc, seconds, err = run_memprof("fit", "--memory", f"{limit}B", "--scale", a.scale_arg, a.scale, "-o",
                                   str(tmp / "scale"), *common, script[0], "--", *script[1:], cwd=tmp)
    print(f"scale: {seconds:.0f} s, exit {rc} {err}", flush=True)
    scaled = json.loads((tmp / "scale" / "fit.json").read_text())
    scaled["seconds"] = round(seconds, 1)
    scaled["next_up"] = next_up(scaled, a.scale_arg, values, script, tmp, tmp)
    report(a, rows, scaled, tmp)


def report(a: argparse.Namespace, rows: list[dict[str, Any]], scaled: dict[str, Any] | None, tmp: Path) -> None:
    """Write `--json` and print the table (and the scale's line, once it ran)."""
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "scale": scaled, "dir": str(tmp)}, indent=1))
    print(f"\n{a.model}{' (full)' if a.full else ''}, budgets {a.budgets} (stock and light), files in {tmp}\n")
    print("| limit | bytes | answer | predicted allocated | measured allocated | error | measured reserved "
          "| predicted reserved | runs | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        err_text = f"{100 * r['error']:+.2f}%" if r["error"] is not None else ""
        print(f"| {r['limit']} | {r['limit_bytes']:,} | {'FITS' if r['fits'] else 'DOES NOT FIT'}: {r['choice']} "
              f"| {r['predicted_bytes'] or 0:,} | {r['measured_bytes'] or 0:,} | {err_text} "
              f"| {_n(r['reserved_bytes'])} | {_n(r['predicted_reserved'])} | {r['runs']} | {r['seconds']} |",
              flush=True)
    for r in rows:  # where a prediction is off by more than 0.5%: what each side held, by category
        cats = r["categories"]
        if r["error"] is None or abs(r["error"]) <= 0.005 or cats is None:
            continue
        print(f"\n{r['limit']}, {cats['config']}: predicted at its peak (the step's bytes; resident "
              f"{_n(cats['predicted_resident'])} B) against the run at its peak (the whole process; resident "
              f"{_n(cats['measured_resident'])} B)")
        print("| category | predicted (step) | measured (process) |\n|---|---|---|")
        for key in sorted(set(cats["predicted_step"]) | set(cats["measured"])):
            print(f"| {key} | {_n(cats['predicted_step'].get(key))} | {_n(cats['measured'].get(key))} |")
    timed = [r for r in rows if "chosen_ms" in r and r["fits"]]
    if timed:
        print("\n| limit | choice, step ms (forward + backward) | fastest predicted to fit, ms | choice / fastest |")
        print("|---|---|---|---|")
        for r in timed:
            fast, mine = r["fastest_fitting"], r["chosen_ms"]
            ratio = f"{mine / fast['ms']:.3f}" if fast and mine else ""
            fastest = f"{fast['config']}: {fast['ms']:.1f}" if fast else ""
            print(f"| {r['limit']} | {r['choice']}: {mine or 0:.1f} | {fastest} | {ratio} |", flush=True)
    if scaled is not None:
        up = scaled["next_up"]
        print(f"\n--scale {a.scale_arg} {a.scale} under {scaled['limit_bytes']:,} B: answer {scaled['value']} "
              f"({'fits' if scaled['fits'] else 'not proved'}; measured {scaled['measured_peak_bytes'] or 0:,} B, "
              f"reserved {_n(scaled['measured_reserved_bytes'])} B; {scaled['seconds']} s); next value up: "
              + (f"{up['value']} at {up['config']}: {up['peak_bytes']:,} B allocated, reserved "
                 f"{_n(up['reserved_bytes'])} B{', OOM' if up['oom'] else ''} -> "
                 f"{'over the limit: the answer is the largest' if up['over'] else 'UNDER the limit'}"
                 if up else "none (the answer is the scale's last value, or there is none)"), flush=True)
        print("probes (predicted allocated peak, of the choice or else the smallest): " + "; ".join(
            f"{p['value']}: {'fits' if p['fits'] else 'over'} at {p.get('budget')} {p.get('remat') or 'stock'}, "
            f"{p.get('predicted_peak_bytes') or 0:,} B" for p in scaled["probes"]), flush=True)


if __name__ == "__main__":
    main()
