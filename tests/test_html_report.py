"""The HTML leaderboard: built from a real (tiny) run, then opened in headless Chromium (Debian's chromium
and chromium-driver, installed by .ci/run): no console errors, table rows equal the store's rows, sorting
works, and a screenshot is saved (path printed; $LRQ_BENCH_ARTIFACTS keeps it)."""

import os
import re
import shutil
from pathlib import Path

import pytest

from bench.cli import main
from bench.html_report import scatter_svg
from bench.store import ResultStore


@pytest.fixture(scope="module")
def report(tiny_model_dir, data_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    results = tmp / "r.sqlite"
    args = ["run", "--profile", "full", "--tasks", "none", "--model", str(tiny_model_dir), "--methods", "rtn,lrq",
            "--schemes", "w4a16,w3a16",
            "--datasets", "wikitext2,c4", "--data-dir", str(data_dir), "--results", str(results),
            "--max-eval-tokens", "1024", "--eval-seq-len", "256", "--calib-samples", "6", "--calib-seq-len", "32",
            "--set", "iters=2", "--set", "heldout_samples=2"]
    # --set applies to every method: run LRQ with its settings, RTN separately
    i = args.index("--methods") + 1
    assert main(args[:i] + ["rtn"] + args[i + 1:-4]) == 0
    assert main(args[:i] + ["lrq"] + args[i + 1:] + ["--no-fp"]) == 0
    assert main(["report", "--results", str(results), "--out", str(tmp / "rep")]) == 0
    return results, tmp / "rep" / "leaderboard.html"


def test_html_tables_hold_every_stored_perplexity(report):
    results, page = report
    text = page.read_text()
    rows = [r for r in ResultStore(results).rows(latest=True) if r.metric == "ppl"]
    for ds in ("wikitext2", "c4"):
        table = re.search(rf'<table class="sortable" data-dataset="{ds}">(.*?)</table>', text, re.S).group(1)
        got = set(re.findall(r'data-method="([^"]+)" data-scheme="([^"]+)"', table))
        assert got == {(r.method, r.scheme) for r in rows if r.dataset == ds}
    assert "<svg" in text and "Figure 2" in text and "git_rev" in text   # charts and provenance inline
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")   # nothing fetched


def test_scatter_svg_handles_degenerate_input():
    assert scatter_svg([], "x", "y") == ""
    assert scatter_svg([("a", 4.0, 10.0)], "x", "y").startswith("<svg")


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.fail("headless Chromium is needed for the browser test: apt-get install chromium chromium-driver "
                    "(.ci/run does this)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,2400"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver_bin), options=opts)


def test_html_in_a_real_browser(report, tmp_path):
    from selenium.webdriver.common.by import By
    results, page = report
    driver = _browser()
    try:
        driver.get(page.resolve().as_uri())
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert errors == []
        stored = [r for r in ResultStore(results).rows(latest=True) if r.metric == "ppl" and r.dataset == "wikitext2"]
        table = driver.find_element(By.CSS_SELECTOR, 'table[data-dataset="wikitext2"]')
        body = table.find_elements(By.CSS_SELECTOR, "tbody tr")
        shown = {(tr.get_attribute("data-method"), tr.get_attribute("data-scheme")): tr.find_elements(
            By.TAG_NAME, "td")[3].text for tr in body}
        assert shown == {(r.method, r.scheme): f"{r.value:.2f}" for r in stored}
        # sort by perplexity (click twice: descending) and check the order the browser shows
        th = table.find_elements(By.TAG_NAME, "th")[3]
        th.click()
        th.click()
        vals = [float(tr.find_elements(By.TAG_NAME, "td")[3].text) for tr in table.find_elements(By.CSS_SELECTOR,
                                                                                              "tbody tr")]
        assert vals == sorted(vals, reverse=True)
        out_dir = Path(os.environ.get("LRQ_BENCH_ARTIFACTS", tmp_path))
        out_dir.mkdir(parents=True, exist_ok=True)
        shot = out_dir / "leaderboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
    finally:
        driver.quit()
