"""`memprof export --format html`: one self-contained page, checked in a real browser (headless
Chromium driven by Selenium): it loads with no console errors, shows the capture's peak to the
byte, its live table sums to the bytes at the point shown, and a click moves the table."""

from __future__ import annotations

import gc
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import memprof

from ..conftest import invoke_memprof, one_line_error

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _export(capture: Path, out: Path) -> str:
    res = invoke_memprof("export", str(capture), "--format", "html", "-o", str(out), cwd=out.parent)
    assert res.returncode == 0, res.stderr
    return out.read_text(encoding="utf-8")


def test_the_page_is_self_contained(tmp_path: Path) -> None:
    html = _export(FIXTURES / "gpt2_bf16_cpu.memprof", tmp_path / "r.html")
    # nothing is fetched: no external script, style, image or font, and a policy that forbids it
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "fetch(" not in html and "XMLHttpRequest" not in html
    assert "default-src 'none'" in html
    data = html[html.index('id="memprof-data">') + 18:html.index("</script>", html.index('id="memprof-data">'))]
    assert "</" not in data  # the JSON cannot end its own element
    assert len(html) < 1_000_000


def test_bad_exports_are_one_line(tmp_path: Path) -> None:
    gc.disable()  # (a collection inside would free earlier tests' tensors: events to draw)
    try:
        with memprof.capture() as empty:
            pass
    finally:
        gc.enable()
    empty.save(tmp_path / "empty.memprof")
    # a fresh process's block that saw only a collection: two markers, no allocation
    subprocess.run([sys.executable, "-c", "import gc, memprof\nwith memprof.capture(output='marks.memprof'):\n"
                    "    gc.collect()"], cwd=tmp_path, check=True)
    assert len(memprof.load(tmp_path / "marks.memprof").raw) == 2
    for name in ("empty", "marks"):
        assert "recorded no allocation on any device" in one_line_error(invoke_memprof(
            "export", f"{name}.memprof", "--format", "html", cwd=tmp_path))


def _driver() -> Any:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.skip("no Chromium and chromedriver here (Debian: apt install chromium chromium-driver; "
                    "tools/setup.sh installs them where it runs as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(service=Service(driver_bin), options=opts)


def _open(driver: Any, page: Path) -> float:
    """Load the page, wait for its script to have drawn everything, check the console has no error;
    the seconds it took."""
    t0 = time.perf_counter()
    driver.get(page.as_uri())
    for _ in range(100):
        if driver.execute_script("return document.body.dataset.ready") == "1":
            break
        time.sleep(0.05)
    assert driver.execute_script("return document.body.dataset.ready") == "1", "the page's script did not finish"
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
    return time.perf_counter() - t0


@pytest.mark.browser
@pytest.mark.parametrize("fixture", ["gpt2_bf16_cpu.memprof", "tiny_compiled_cuda.memprof"])
def test_the_page_in_a_browser(fixture: str, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    cap = memprof.load(FIXTURES / fixture)
    device = cap.main_device
    page = tmp_path / "r.html"
    _export(FIXTURES / fixture, page)
    driver = _driver()
    try:
        loaded = _open(driver, page)
        # the peak, to the byte, as the capture has it; the main device first
        assert int(driver.find_element(By.ID, f"peak-{device}").get_attribute("data-bytes")) == cap.peak(device)
        label = driver.find_element(By.ID, "at-label")
        assert label.get_attribute("data-device") == device
        assert int(label.get_attribute("data-bytes")) == cap.peak(device)
        total = driver.find_element(By.ID, "live-total")
        assert int(total.get_attribute("data-bytes")) == cap.peak(device)  # the table's rows sum to it
        driver.save_screenshot(str(tmp_path / "peak.png"))
        # a click elsewhere on the timeline: the table follows, exactly
        canvas = driver.find_element(By.ID, "timeline")
        width = canvas.size["width"]
        ActionChains(driver).move_to_element_with_offset(canvas, int(-width * 0.3), 0).click().perform()
        pos = int(label.get_attribute("data-pos"))
        tl = cap.timeline(device)
        assert pos != tl.peak_pos
        assert int(label.get_attribute("data-bytes")) == tl.allocated_at_pos(pos)
        assert int(total.get_attribute("data-bytes")) == tl.allocated_at_pos(pos)
        rows = driver.find_elements(By.CSS_SELECTOR, "#live-body tr")
        assert rows, "no rows at the clicked point"
        # sorting by a column header reorders the rows
        driver.find_element(By.CSS_SELECTOR, "#live thead th[data-key=category]").click()
        cats = [r.find_elements(By.TAG_NAME, "td")[3].text for r in driver.find_elements(By.CSS_SELECTOR,
                                                                                       "#live-body tr:not(.rest)")]
        assert cats == sorted(cats)
        driver.save_screenshot(str(tmp_path / "clicked.png"))
        assert (tmp_path / "clicked.png").stat().st_size > 10_000
        assert loaded < 10  # (first-paint figures are benchmarks: docs/benchmarks.md)
    finally:
        driver.quit()


@pytest.mark.browser
def test_a_distributed_runs_page_has_a_tab_per_rank(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    from memprof.reporters import Run, write

    caps = {0: memprof.load(FIXTURES / "gpt2_bf16_cpu.memprof"), 1: memprof.load(FIXTURES / "tiny_compiled.memprof")}
    page = write("html", Run("run.memprof", caps, 2), tmp_path / "run.html")
    driver = _driver()
    try:
        _open(driver, page)
        tabs = [b.text for b in driver.find_elements(By.CSS_SELECTOR, "#tabs button")]
        assert tabs == ["rank 0: cpu", "rank 1: cpu"]
        for r, cap in caps.items():  # each rank's peak to the byte
            assert int(driver.find_element(By.ID, f"peak-rank {r}: cpu").get_attribute("data-bytes")) == cap.peak("cpu")
        driver.find_elements(By.CSS_SELECTOR, "#tabs button")[1].click()
        total = driver.find_element(By.ID, "live-total")
        assert int(total.get_attribute("data-bytes")) == caps[1].peak("cpu")
        # the ranks side by side, one lane each on one axis, each its peak; a click shows that one above
        lanes = driver.find_elements(By.CSS_SELECTOR, "#lanes .lane")
        assert [lane.get_attribute("data-device") for lane in lanes] == ["rank 0: cpu", "rank 1: cpu"]
        assert [int(lane.get_attribute("data-peak")) for lane in lanes] == [caps[0].peak("cpu"), caps[1].peak("cpu")]
        lanes[0].click()
        on = driver.find_element(By.CSS_SELECTOR, "#tabs button.on")
        assert on.text == "rank 0: cpu"
        assert int(total.get_attribute("data-bytes")) == caps[0].peak("cpu")
        driver.save_screenshot(str(tmp_path / "run.png"))
    finally:
        driver.quit()


def test_a_plans_detail_adds_up_and_names_what_the_remat_pass_saved() -> None:
    """The page's plan detail (pure): saved values listed and summed, by layer and in total, to the
    summary's saved bytes; the pass's added layer boundaries are among the saved values, with bytes."""
    from memprof.analysis.plan_view import plan_detail
    from memprof.analysis.summary import plan_summary

    cap = memprof.load(FIXTURES / "llama_remat_cpu.memprof")
    (plan,) = cap.plans
    d = plan_detail(plan, top=5)
    assert d["saved_bytes"] == plan_summary(plan).saved_bytes == 539_392  # the text report: 539.4 kB
    assert sum(v["bytes"] for v in d["saved"]) + d["saved_rest"]["bytes"] == d["saved_bytes"]
    assert len(d["saved"]) == 5 and d["saved_rest"]["count"] == len(plan.saved) - 5
    assert [v["bytes"] for v in d["saved"]] == sorted((v["bytes"] for v in d["saved"]), reverse=True)
    assert sum(r["saved_bytes"] for r in d["by_layer"]) == d["saved_bytes"]
    assert sum(r["recomputed"] for r in d["by_layer"]) == len(plan.recomputed)
    layers = [r["layer"] for r in d["by_layer"]]
    numbered = [x for x in layers if x.startswith("layers.")]
    assert numbered == sorted(numbered, key=lambda x: int(x.split(".")[1]))  # model order, not text order
    remat = d["remat"]
    assert remat is not None and remat["mode"] == "light" and remat["saved_added"]
    assert {v["name"] for v in remat["saved_added"]} <= set(plan.saved)
    assert all(v["bytes"] and v["layer"] for v in remat["saved_added"])
    assert plan_detail(memprof.load(FIXTURES / "tiny_compiled.memprof").plans[0])["remat"] is None


@pytest.mark.browser
def test_the_plans_section_shows_each_plan_and_the_remat_pass(tmp_path: Path) -> None:
    """Each plan's detail, memprof's remat pass, and where Dynamo broke graphs."""
    from selenium.webdriver.common.by import By

    cap = memprof.load(FIXTURES / "llama_remat_cpu.memprof")
    said = "train_<b>x</b>.py:3 in f: Call to `torch._dynamo.graph_break()`"  # (text, never markup)
    cap.meta["graph_breaks"] = [said]
    cap.save(tmp_path / "breaks.memprof")
    page = tmp_path / "remat.html"
    _export(tmp_path / "breaks.memprof", page)
    driver = _driver()
    try:
        _open(driver, page)
        plans = driver.find_element(By.ID, "plans").text
        assert "graph breaks: Dynamo compiled the code in parts, split at 1 place" in plans and said in plans
        box = driver.find_element(By.ID, "plan-0")
        box.find_element(By.TAG_NAME, "summary").click()
        from memprof.analysis.summary import plan_summary

        assert int(box.get_attribute("data-saved-bytes")) == plan_summary(cap.plans[0]).saved_bytes
        foot = box.find_elements(By.CSS_SELECTOR, "tfoot td")
        assert foot[-1].text.replace(",", "") == str(plan_summary(cap.plans[0]).saved_bytes)
        remat = driver.find_element(By.ID, "remat-0")
        assert "memprof's remat pass (light, applied)" in remat.text and "layer boundaries saved:" in remat.text
        driver.execute_script("arguments[0].scrollIntoView()", box)
        driver.save_screenshot(str(tmp_path / "plans.png"))
    finally:
        driver.quit()


def test_ranks_that_ran_together_on_one_host_share_the_lanes_time_axis(tmp_path: Path) -> None:
    import json

    from memprof.reporters import Run, write

    cap = memprof.load(FIXTURES / "tiny_compiled.memprof")
    other = memprof.load(FIXTURES / "gpt2_bf16_cpu.memprof")

    def lanes(caps: dict[int, memprof.Capture]) -> tuple[dict[str, object], list[float]]:
        html = write("html", Run("run.memprof", caps, len(caps)), tmp_path / "run.html").read_text()
        start = html.index('id="memprof-data">') + 18
        data = json.loads(html[start:html.index("</script>", start)])
        return data["lanes"], [d["offset_s"] for d in data["devices"]]

    assert lanes({0: cap, 1: cap}) == ({"aligned": True, "why_not": ""}, [0.0, 0.0])
    assert lanes({0: cap, 1: other}) == ({"aligned": False, "why_not": "the ranks did not run together"}, [0.0, 0.0])
