"""The API docs in a real browser (Debian's headless Chromium driven by Playwright, as in the
dashboard's browser test): what the page asks for while it renders, and from whom."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.dashboard.test_browser import CHROMIUM, CHROMIUM_FLAGS

pytestmark = pytest.mark.browser


def test_the_redoc_page_requests_nothing_from_another_host(live_server, settings):
    """ReDoc renders from this server alone; what its script asks of another host (the Redocly
    logo) the page's content security policy refuses before any byte leaves the browser."""
    requested: list[str] = []
    refused: dict[str, str | None] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.on("request", lambda request: requested.append(request.url))
            page.on("requestfailed", lambda request: refused.update({request.url: request.failure}))
            page.goto(f"{live_server.url}/api/redoc/")
            expect(page.get_by_role("heading", name=settings.SPECTACULAR_SETTINGS["TITLE"])).to_be_visible()
            expect(page.get_by_text("API docs by Redocly")).to_be_visible()  # beside it: the logo
            page.wait_for_load_state("networkidle")
        finally:
            browser.close()
    assert f"{live_server.url}/api/schema/" in requested
    elsewhere = [url for url in requested if not url.startswith((live_server.url, "blob:", "data:"))]
    assert {url: refused.get(url) for url in elsewhere} == dict.fromkeys(elsewhere, "csp")
