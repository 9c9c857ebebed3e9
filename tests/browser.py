"""A page opened from a file URL in headless Chromium (the Debian package CI installs), driven by playwright:
every request is recorded, and any that is not for a file or data URL is refused. The report's and the routing
explorer's browser tests share it."""

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WIDTH = 1280  # a laptop's browser window: pages must fit it without scrolling sideways
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@contextmanager
def opened(path: Path, height: int = 900) -> Iterator[tuple[object, dict]]:
    """(the playwright page, what it did: "requests" (every URL asked for), "external" (refused), "failed",
    "errors" (console errors and uncaught exceptions))."""
    from playwright.sync_api import sync_playwright

    seen = {"requests": [], "external": [], "failed": [], "errors": []}

    def guard(route):
        if route.request.url.startswith(("file:", "data:")):
            route.continue_()
        else:
            seen["external"].append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": height})
            page.on("console", lambda m: seen["errors"].append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: seen["errors"].append(str(e)))
            page.on("request", lambda r: seen["requests"].append(r.url))
            page.on("requestfailed", lambda r: seen["failed"].append(r.url))
            page.route("**/*", guard)
            page.goto(Path(path).resolve().as_uri())
            yield page, seen
        finally:
            browser.close()
