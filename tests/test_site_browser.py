"""The built site in a real browser (headless Chromium, tests/browser.py): every page loads with no console error
and draws its charts, every link resolves, sorting and filtering change the rows shown, and the numbers shown are
the Parquet rows' own, computed again by hand (tests/site_data.py); a screenshot of the leaderboard and of a run."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from tests import browser
from tests.conftest import skip_unless_ci
from tests.site_data import expected, other_kinds, run_rows, write_run

RUNS = {"run-a": ("ngram", "cpu:machine-a", 1.5), "run-b": ("suffix", "cuda:machine-b", 2.2)}


@pytest.fixture(scope="module")
def session():
    found = browser.binaries()
    if found is None:
        skip_unless_ci("needs Chromium and its WebDriver (Debian: chromium, chromium-driver; `make browser`)")
    driver = browser.start(*found)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from sdbench.reporting.site.build import build_site

    results = tmp_path_factory.mktemp("results")
    rows = {}
    for run_id, (strategy, hardware, scale) in RUNS.items():
        rows[run_id] = run_rows(strategy, hardware, scale)
        write_run(results, run_id, rows[run_id])
    write_run(results, "run-cut", run_rows("ngram", "cpu:machine-a", 1.1), finish=False)
    (results / "broken.parquet").write_bytes(b"not parquet at all")
    other_kinds(results / "more")
    out = tmp_path_factory.mktemp("site")
    build_site([str(results)], out, Console(file=io.StringIO()))
    return out, rows


def _rows(session, table: str = "leaderboard") -> list[dict]:
    """The rows the table shows now, as {header: text}."""
    return session.execute_script("""
        const t = document.getElementById(arguments[0]);
        const heads = Array.from(document.querySelectorAll('#' + arguments[0] + '_wrapper thead th'))
            .map(th => th.innerText.trim()).slice(0, t.tHead.rows[0].cells.length);
        return Array.from(t.tBodies[0].rows).filter(tr => tr.cells.length > 1).map(
            tr => Object.fromEntries(Array.from(tr.cells).map((td, i) => [heads[i], td.innerText.trim()])));
    """, table)


def test_every_page_loads_without_console_errors(session, site):
    out, _ = site
    pages = sorted(out.rglob("*.html"))
    assert len(pages) >= 10
    slowest = 0.0
    for page in pages:
        started = time.perf_counter()
        assert browser.open_page(session, page) == [], page
        slowest = max(slowest, time.perf_counter() - started)
        if "reproductions" not in page.parts:  # a reproduction's own report is copied as it is
            assert session.execute_script("return document.body.dataset.ready") == "1", page
            charts = session.execute_script("return document.querySelectorAll('script.sd-figure').length")
            drawn = session.execute_script("return document.querySelectorAll('.sd-chart .main-svg').length")
            assert drawn >= charts, page
    print(f"{len(pages)} pages, slowest load {slowest:.2f} s")


def test_every_link_resolves(session, site):
    out, _ = site
    for page in sorted(out.rglob("*.html")):
        browser.open_page(session, page)
        links = session.execute_script("return Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
        for link in links:
            assert link.startswith("file://"), (page, link)  # nothing on the network
            target = link.removeprefix("file://").split("#")[0]
            assert (out / "x").parent.joinpath(target).exists(), (page, link)


def _until(session, holds, table: str = "leaderboard", seconds: float = 15.0) -> list[dict]:
    """The rows shown once `holds(rows)` is true (DataTables may redraw a moment after a key or click)."""
    deadline = time.monotonic() + seconds
    while True:
        rows = _rows(session, table)
        if holds(rows):
            return rows
        assert time.monotonic() < deadline, rows
        time.sleep(0.1)


def _speedups(rows) -> list[float]:
    return [float(r["speedup"].rstrip("x")) for r in rows]


def test_sorting_and_filtering_change_the_rows(session, site):
    out, _ = site
    browser.open_page(session, out / "index.html")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def choose(name, value):
        Select(session.find_element(By.CSS_SELECTOR, f"select[data-name={name}]")).select_by_value(value)

    shown = _rows(session)
    assert {r["category"] for r in shown} == {"ALL"} and {r["run"] for r in shown} >= set(RUNS)
    choose("strategy", "suffix")
    _until(session, lambda rows: {r["strategy"] for r in rows} == {"suffix"})
    choose("category", "math")
    _until(session, lambda rows: {(r["strategy"], r["category"]) for r in rows} == {("suffix", "math")})
    choose("strategy", "")
    choose("category", "ALL")
    everything = _until(session, lambda rows: len(rows) == len(shown))
    search = session.find_element(By.CSS_SELECTOR, "#leaderboard_wrapper input[type=search]")
    search.send_keys("machine-b")
    _until(session, lambda rows: {r["hardware"] for r in rows} == {"cuda:machine-b"})
    search.clear()
    search.send_keys(" ")  # an edit event with an empty search: every row again
    _until(session, lambda rows: len(rows) == len(everything))

    def sort_speedup(direction: str) -> None:
        """Click the header once, and wait until DataTables says it orders that column that way."""
        header = next(th for th in session.find_elements(By.CSS_SELECTOR, "#leaderboard_wrapper thead th")
                      if th.text.strip() == "speedup")
        header.click()
        deadline = time.monotonic() + 15
        while f"dt-ordering-{direction}" not in (header.get_attribute("class") or ""):
            assert time.monotonic() < deadline, header.get_attribute("class")
            time.sleep(0.1)

    sort_speedup("asc")
    first = _until(session, lambda rows: _speedups(rows) == sorted(_speedups(rows)))
    sort_speedup("desc")
    second = _until(session, lambda rows: _speedups(rows) == sorted(_speedups(rows), reverse=True))
    assert len(first) > 2 and len(set(_speedups(first))) > 2 and sorted(_speedups(second)) == _speedups(first)


def test_numbers_shown_are_the_parquets(session, site, tmp_path):
    out, rows = site
    browser.open_page(session, out / "index.html")
    shown = {r["run"]: r for r in _rows(session)}
    for run_id, run_rows_ in rows.items():
        want, got = expected(run_rows_), shown[run_id]
        assert got["speedup"] == f"{want['speedup']:.2f}x"
        assert got["accepted length per step"] == f"{want['mean_accepted_len']:.2f}"
        assert got["acceptance"] == f"{want['acceptance_rate']:.2f}"
        assert got["by position"] == " ".join(f"{r:.2f}" for r in want["by_position"])
        assert got["hardware"] == RUNS[run_id][1] and got["lossless"] == "yes"
    assert shown["run-cut"]["note"] == "partial run"
    board = tmp_path / "leaderboard.png"
    session.save_screenshot(str(board))
    browser.open_page(session, out / "runs" / "run-a.html")
    assert [r["speedup"] for r in _rows(session, "run-table")] == [shown["run-a"]["speedup"]]
    run_page = tmp_path / "run.png"
    session.save_screenshot(str(run_page))
    for png in (board, run_page):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_problems_are_on_the_page(session, site):
    out, _ = site
    browser.open_page(session, out / "index.html")
    text = session.execute_script("return document.body.innerText")
    assert "broken.parquet: cannot be read as Parquet" in text
    assert "run run-cut stopped before its end: RuntimeError: out of memory at prompt p3" in text
