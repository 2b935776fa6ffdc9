"""What exporting a capture costs, per format, and how fast the HTML report paints.

    python tools/bench_export.py run.memprof [--formats chrome,html,snapshot] [--browser]

Each format is written by `memprof export` in its own process (wall seconds and the process's peak
resident memory, from `resource.getrusage` of the child), the file's size is read back; with
`--browser`, the HTML page is opened in headless Chromium (Selenium) and its first contentful
paint and the time until its script has drawn everything are read from the page. The last output
is the table.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def export(capture: Path, fmt: str, out: Path) -> tuple[float, float]:
    """(wall seconds, peak resident MB) of `memprof export` in a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "memprof", "export", str(capture), "--format", fmt, "-o", str(out),
                    "--force"], check=True, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(after, before) / 1e3  # (the largest child so far: run the formats largest last)


def paint(page: Path) -> tuple[float, float]:
    """(first contentful paint ms, ms until the page's script finished) in headless Chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=opts)
    try:
        driver.get(page.as_uri())
        for _ in range(400):
            if driver.execute_script("return document.body.dataset.ready") == "1":
                break
            time.sleep(0.025)
        ready = driver.execute_script("return performance.now()")
        fcp = -1.0  # the paint entry can arrive after the script's last line: wait up to 2 s for it
        for _ in range(80):
            fcp = driver.execute_script("const e = performance.getEntriesByName('first-contentful-paint'); "
                                        "return e.length ? e[0].startTime : -1")
            if fcp >= 0:
                break
            time.sleep(0.025)
        return float(fcp), float(ready)
    finally:
        driver.quit()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture", type=Path)
    p.add_argument("--formats", default="snapshot,html,chrome")
    p.add_argument("--browser", action="store_true", help="also time the HTML page in headless Chromium")
    args = p.parse_args()
    import memprof

    cap = memprof.load(args.capture)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            out = Path(tmp) / f"out.{fmt}"
            wall, rss = export(args.capture, fmt, out)
            extra = ""
            if fmt == "html" and args.browser:
                fcp, ready = paint(out)
                extra = f"first paint {fcp:.0f} ms, drawn {ready:.0f} ms"
            rows.append(f"| {fmt} | {wall:.2f} | {rss:.0f} | {os.path.getsize(out) / 1e6:.2f} | {extra} |")
    print(f"capture: {args.capture} ({len(cap.raw):,} events, {os.path.getsize(args.capture) / 1e6:.1f} MB)")
    print("| format | export s | peak RSS MB (largest child so far) | file MB | browser |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
