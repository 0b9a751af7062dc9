"""The web view as a person sees it, in Debian's headless Chromium at a 1280 px viewport.

Over the made-up cluster of slurm_idle.testing.webview (no sandbox: the pages' layout, times
and who-sees-what do not depend on a live Slurm): every page fits 1280 px with no cell
overflowing, times are local and readable (log `t=` stamps too, the file untouched), a user
sees their own jobs first and only their own logs, and an unknown forecast says why.
With SLURM_IDLE_DOCS_SCREENSHOTS=DIR the pool and jobs pages are saved there as
web-pool.png and web-jobs.png (palette PNGs): that is how docs/img/ gets them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.testing import browser as br
from slurm_idle.testing.webview import BOB_SECRET, LONG_NAME, TIMEZONE, SampleData

WIDTH, HEIGHT = 1280, 860
HEADER = "X-Remote-User"

@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, Path]]:
    """The view over the made-up cluster, and a browser at 1280 px: (url, driver, state dir)."""
    if reason := br.missing():
        pytest.skip(reason)
    pytest.importorskip("flask")
    from slurm_idle.web import create_app

    root = tmp_path_factory.mktemp("webview")
    app = create_app(SampleData(root / "state"), timezone=TIMEZONE, user_header=HEADER)
    with br.served(app) as url, br.chromium(root / "chromium", WIDTH, HEIGHT) as driver:
        br.set_viewport(driver, WIDTH, HEIGHT)
        yield url, driver, root / "state"


def load(driver: Any, url: str, user: str | None) -> str:
    br.set_headers(driver, {HEADER: user} if user else {})
    driver.get(url)
    return str(driver.page_source)


def shot(driver: Any, name: str) -> None:
    """Save the whole page as web-<name>.png in $SLURM_IDLE_DOCS_SCREENSHOTS, when set."""
    where = os.environ.get("SLURM_IDLE_DOCS_SCREENSHOTS")
    if not where:
        return
    from PIL import Image

    path = Path(where) / f"web-{name}.png"
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    br.set_viewport(driver, WIDTH, height)  # the whole page, still 1280 px wide
    try:
        driver.save_screenshot(str(path))
    finally:
        br.set_viewport(driver, WIDTH, HEIGHT)
    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


@pytest.mark.parametrize(("page", "user"), [("/", None), ("/jobs", "alice"),
                                            ("/jobs?user=bob", "alice"), ("/jobs", None)])
def test_every_page_fits_1280_px_with_no_clipped_cell(
    site: tuple[str, Any, Path], page: str, user: str | None
) -> None:
    """At a 1280 px viewport nothing is wider than the window and no table cell, log or note
    overflows its box (the long job name, the 240-character log line, the wide DAG wrap or
    scale); the jobs page still shows every column of every job."""
    url, driver, _ = site
    load(driver, url + page, user)
    width, overflows = br.overflows(driver)
    assert width == WIDTH
    assert overflows == [], overflows
    if page == "/jobs" and user:
        from selenium.webdriver.common.by import By

        rows = driver.find_elements(By.CSS_SELECTOR, "#jobs tr[data-job]")
        assert len(rows) == 8
        assert all(len(r.find_elements(By.TAG_NAME, "td")) == 11 for r in rows)
        assert LONG_NAME in rows[0].text
        dag = driver.find_element(By.CSS_SELECTOR, 'section[data-pipeline="eval-suite"] svg.dag')
        assert int(dag.get_attribute("width")) > WIDTH > dag.rect["width"]  # scaled, not cut
        shot(driver, "jobs")
    elif page == "/":
        shot(driver, "pool")


def test_times_are_local_and_readable_and_the_log_file_is_untouched(
    site: tuple[str, Any, Path],
) -> None:
    """The header names the zone; log stamps read as Berlin times (today's as a clock time,
    yesterday's with the day) with the raw stamp as their title; no epoch is left on the
    page, and the file on disk still has its epochs."""
    from selenium.webdriver.common.by import By

    url, driver, root = site
    load(driver, url + "/jobs", "alice")
    text = driver.find_element(By.TAG_NAME, "body").text
    assert "times in Europe/Berlin (CET)" in text and "as of 17:30" in text
    assert re.search(r"t=\d{10}", text) is None, "an epoch stamp left on the page"
    stamps = {t.text: t.get_attribute("title") for t in driver.find_elements(By.CSS_SELECTOR,
                                                                            "pre.log time")}
    assert stamps["t=Sun 6 Dec 21:30:00"] == "t=1796589000.4"
    assert stamps["t=17:26:00"].startswith("t=17966")  # 4 min ago: today, a clock time
    assert "checkpoint step=800 t=17:26:00" in text
    raw = (root / "logs" / "alice-4107.out").read_text()
    assert "t=1796589000.4" in raw and "t=Sun" not in raw
    assert "submitted 14:30" in text  # the pipeline, 3 hours ago


def test_a_user_sees_only_their_own_job_logs(site: tuple[str, Any, Path]) -> None:
    """With the proxy's header naming alice, bob's job is listed but his log tail is not in
    the page (not even with ?user=bob); named bob, he sees it; unnamed, no one's is shown."""
    url, driver, _ = site
    html = load(driver, url + "/jobs", "alice")
    assert 'data-job="4102"' in html and BOB_SECRET not in html
    assert "checkpoint step=800" in html
    assert "shown to their owner only" in html
    html = load(driver, url + "/jobs?user=bob", "alice")
    assert 'data-job="4102"' in html and BOB_SECRET not in html
    assert BOB_SECRET in load(driver, url + "/jobs", "bob")
    html = load(driver, url + "/jobs", None)
    assert BOB_SECRET not in html and "checkpoint step=800" not in html
    assert 'class="log"' not in html and "does not know who you are" in html


def test_the_viewers_own_jobs_come_first(site: tuple[str, Any, Path]) -> None:
    """bob's job is the oldest: alice sees her six first, marked as hers; bob sees his first,
    then the others in job id order."""
    from selenium.webdriver.common.by import By

    url, driver, _ = site
    for viewer, order in (("alice", ["alice"] * 6 + ["bob", "carol"]),
                          ("bob", ["bob", "alice", "carol"] + ["alice"] * 5)):
        load(driver, url + "/jobs", viewer)
        rows = driver.find_elements(By.CSS_SELECTOR, "#jobs tr[data-job]")
        assert [r.get_attribute("data-user") for r in rows] == order
        assert len(driver.find_elements(By.CSS_SELECTOR, "tbody.mine")) == order.count(viewer)


def test_an_unknown_forecast_and_best_time_say_why(site: tuple[str, Any, Path]) -> None:
    """Three of the next seven hours are unknown (21 hours of history): the page says so and
    what is needed; the best time says what it offers."""
    from selenium.webdriver.common.by import By

    url, driver, _ = site
    load(driver, url + "/", None)
    cells = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#outlook td:nth-child(2)")]
    assert cells.count("unknown") == 3
    note = driver.find_element(By.ID, "outlook-note").text
    assert note.startswith("unknown (3 of 7 hours)") and "24 hours of demand history" in note
    assert driver.find_element(By.ID, "best-time").text == "22:30"
    assert driver.find_element(By.ID, "best-time-note").text == "8 GPUs expected lendable then"
