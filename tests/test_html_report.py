"""The HTML leaderboard: built from a real (tiny) run with two tasks, then opened in headless Chromium (Debian's
chromium and chromium-driver, installed by .ci/run): no console errors, every table and value of the Markdown
leaderboard on the page, table rows equal the store's rows, the FP row a reference spanning the schemes, charts
whose points name their method and scheme with one colour per method and the FP line, sorting works, history
only where a cell has several revisions, and a screenshot is saved (path printed; $LRQ_BENCH_ARTIFACTS keeps
it)."""

import html as htmllib

import os
import re
import shutil
from pathlib import Path

import pytest

from bench.cli import main
from bench.reports.html_report import html_report, scheme_chart
from bench.common.store import ResultStore


@pytest.fixture(scope="module")
def report(tiny_model_dir, data_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    results = tmp / "r.sqlite"
    args = ["run", "--profile", "full", "--tasks", "piqa,arc_easy", "--task-limit", "8", "--model", str(tiny_model_dir), "--methods", "rtn,lrq",
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


def test_scheme_chart_handles_degenerate_input():
    assert scheme_chart([], [("w4a16", 4.0)], "y") == ""
    assert scheme_chart([("a", "w4a16", 10.0)], [("w4a16", 4.0)], "y").startswith("<svg")
    assert scheme_chart([("a", "w4a16", float("nan"))], [("w4a16", 4.0)], "y") == ""


def _text(page: str) -> str:
    """The page's visible text, tags dropped and entities decoded, whitespace collapsed."""
    body = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", page, flags=re.S)
    return " ".join(htmllib.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def test_html_shows_everything_the_markdown_shows(report):
    results, page = report
    text = page.read_text()
    shown = _text(text)
    md = (page.parent / "leaderboard.md").read_text()
    headings = [ln.lstrip("#").strip() for ln in md.splitlines() if ln.startswith("### ")]
    for h in ("Summary", "Scheme w4a16", "Scheme w3a16", "KL divergence from the FP model", "Task accuracy (lm-eval)",
              "Flips against the FP model", "Paired comparisons with FP and RTN", "Quantization cost"):
        assert h in headings
    for h in headings:
        assert re.search(rf"<h4>{re.escape(htmllib.escape(h, quote=False))}</h4>", text), h
    cells = [c.strip().replace("**", "") for ln in md.splitlines() if ln.startswith("|") and not
             re.match(r"^\|[-:| ]+\|$", ln) for c in ln.strip("|").split("|")]
    assert len(cells) > 200
    missing = [c for c in cells if c and " ".join(c.split()) not in shown]
    assert missing == []
    # the flips carry their Wilson intervals and counts, the tasks their intervals
    flips = text[text.index("<h4>Flips against the FP model</h4>"):]
    assert re.search(r"<td>\d+\.\d \[\d+\.\d, \d+\.\d\] \(\d+ r-&gt;w, \d+ w-&gt;r of 8\)</td>", flips)
    assert "history" not in text.lower().split("<script>")[0]       # one revision: no history section


def test_history_only_when_a_cell_has_several_revisions(report):
    from dataclasses import replace
    results, _ = report
    store = ResultStore(results)
    latest = store.rows(latest=True)
    assert "History across git revisions" not in html_report(latest, store.rows())
    older = [replace(r, git_rev="0123456789abcdef", created_at="2026-01-01T00:00:00", value=r.value * 1.01)
             for r in latest if r.metric == "ppl" and r.method == "rtn" and r.scheme == "w4a16"]
    page = html_report(latest, store.rows() + older)
    hist = page[page.index("History across git revisions"):]
    assert "0123456789ab" in hist
    assert set(re.findall(r"<tr><td>(\w+)</td><td>([\w-]+)</td>", hist)) == {("rtn", "w4a16")}   # only that cell


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.fail("headless Chromium is needed for the browser test: run `bash setup.sh` (it runs apt-get install "
                    "chromium chromium-driver), or install chromium and chromedriver with your package manager")
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
        # the FP row of the method x scheme grid: one reference cell spanning every scheme column
        grid = driver.find_element(By.CSS_SELECTOR, 'table[data-grid="wikitext2"]')
        n_schemes = len(grid.find_elements(By.CSS_SELECTOR, "thead th")) - 1
        ref = grid.find_element(By.CSS_SELECTOR, "tr.fp td.ref")
        assert int(ref.get_attribute("colspan")) == n_schemes == 2 and "FP reference" in ref.text
        # charts: perplexity, KLD and top-1 per text; every point names its method and scheme, one colour per
        # method, the FP line on every chart, round tick labels
        charts = driver.find_elements(By.CSS_SELECTOR, "div.chart")
        assert {c.get_attribute("data-chart") for c in charts} == {
            f"{k}-{ds}" for k in ("ppl", "kld", "top1_agree") for ds in ("wikitext2", "c4")}
        cells = {(r.method, r.scheme) for r in stored if r.method != "fp"}
        for c in charts:
            pts = c.find_elements(By.CSS_SELECTOR, "circle.pt")
            assert {(p.get_attribute("data-method"), p.get_attribute("data-scheme")) for p in pts} == cells
            for p in pts:
                title = p.find_element(By.TAG_NAME, "title").get_attribute("textContent")
                assert title.startswith(f"{p.get_attribute('data-method')} {p.get_attribute('data-scheme')}, ")
            colours = {}
            for p in pts:
                colours.setdefault(p.get_attribute("data-method"), set()).add(p.get_attribute("fill"))
            assert all(len(v) == 1 for v in colours.values()) and len({f for v in colours.values() for f in v}) == 2
            assert len(c.find_elements(By.CSS_SELECTOR, "line.ref")) == 1
            for t in c.find_elements(By.CSS_SELECTOR, "text.ytick"):
                assert len(t.text.replace(".", "").lstrip("0")) <= 3, t.text    # 0.02, 450, 60: not 13.5e0 noise
        # the summary (a Markdown table, sortable here): one row per evaluated cell, FP included
        summary = driver.find_element(By.CSS_SELECTOR, "div.summary table")
        assert len(summary.find_elements(By.CSS_SELECTOR, "tbody tr")) == len(cells) + 1
        out_dir = Path(os.environ.get("LRQ_BENCH_ARTIFACTS", tmp_path))
        out_dir.mkdir(parents=True, exist_ok=True)
        shot = out_dir / "leaderboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
    finally:
        driver.quit()


def test_a_missing_browser_fails_with_the_install_command(monkeypatch):
    # never a skip: without chromium/chromedriver the browser test fails, naming the command that installs them
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        _browser()
    except BaseException as e:          # a skip (Skipped) must not pass this test: it is caught and checked here
        outcome = e
    else:
        outcome = None
    assert type(outcome) is pytest.fail.Exception, f"a missing browser must fail the test, got {outcome!r}"
    assert re.search(r"bash setup\.sh.*apt-get install chromium chromium-driver", str(outcome)), str(outcome)
