"""Debian's headless Chromium driven through selenium, and a web app served for it to load.

No browser is downloaded (none can be here): Debian's /usr/bin/chromium and its chromedriver
(`chromium`, `chromium-driver`, installed by scripts/lib/install.sh). The viewport is set
exactly through the DevTools protocol (a window size would include the browser's own frame);
request headers likewise, so a test can play the site's proxy naming the user.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def missing() -> str | None:
    """Why no browser test can run here (None: it can)."""
    import os

    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the browser-test extra)"
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        return "Debian's chromium and chromium-driver are not installed"
    return None


@contextmanager
def chromium(profile: Path, width: int = 1400, height: int = 1100) -> Iterator[Any]:
    """A headless Chromium (selenium WebDriver), quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu",
                f"--window-size={width},{height}", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def set_viewport(driver: Any, width: int, height: int) -> None:
    """The page's layout viewport, exactly `width` x `height` CSS pixels."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})


def set_headers(driver: Any, headers: Mapping[str, str]) -> None:
    """Send `headers` with every later request of this browser ({}: none)."""
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": dict(headers)})


# Every element that sticks out of the viewport, and every cell, log or note whose content
# is wider than its box (spilling over its neighbour or cut off).
OVERFLOWS = """
const vw = window.innerWidth, out = [];
const name = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') + ' "'
  + (el.textContent || '').trim().slice(0, 40) + '"';
if (document.documentElement.scrollWidth > vw)
  out.push('document scrollWidth ' + document.documentElement.scrollWidth);
for (const el of document.querySelectorAll('body *')) {
  const r = el.getBoundingClientRect();
  if (r.width > 0 && r.right > vw + 0.5) out.push(name(el) + ' ends at ' + Math.round(r.right));
}
for (const el of document.querySelectorAll('td, th, pre, summary, p, li')) {
  if (el.scrollWidth > el.clientWidth + 1)
    out.push(name(el) + ' content ' + el.scrollWidth + ' > box ' + el.clientWidth);
}
return [vw, out];
"""


def overflows(driver: Any) -> tuple[int, list[str]]:
    """(the viewport's width, what overflows on the page loaded): [] when the page fits."""
    width, found = driver.execute_script(OVERFLOWS)
    return int(width), [str(f) for f in found]


@contextmanager
def served(app: Any) -> Iterator[str]:
    """`app` (WSGI) on 127.0.0.1 at a port the kernel picks as it binds: its base URL. The
    socket is bound once and kept, so no lease is needed (docs/ci-health.md: the race is a
    port found free, closed, then bound by another process)."""
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="web-under-test", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)
