"""The live status page in a real browser: headless Chromium (Debian's) driven by Playwright.
A sleep issued through the API must show on the page without a reload."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.serve.conftest import API_KEY, Served, make_config, serving, stage_table

CHROMIUM = os.environ.get("OMNI_CORE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
UI_TIMEOUT_MS = 30_000  # the page updates within ~0.5 s; the bound only turns a hang into a failure

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
if not os.path.exists(CHROMIUM):
    if os.environ.get("OMNI_CORE_REQUIRE_BROWSER"):
        raise RuntimeError(f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (Debian) or set "
                           "OMNI_CORE_CHROMIUM")  # fmt: skip
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium; OMNI_CORE_REQUIRE_BROWSER=1 makes this "
                "an error)", allow_module_level=True)  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(autouse=True)
def _running(served: Served) -> None:
    served.settle()


def test_a_sleep_through_the_api_shows_on_the_page(served: Served, browser: object) -> None:
    expect = sync_api.expect
    page = browser.new_page()  # type: ignore[attr-defined]
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(served.url + "/")
    talker_state = page.locator('section[data-stage="talker"] [data-field="state"]')
    expect(talker_state).to_have_text("RUNNING", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#conn")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    expect(page.locator('section[data-stage="talker"] tbody tr')).to_have_count(2)  # one row per rank

    assert served.client.post("/v1/stages/talker/sleep", json={"level": 1}).status_code == 200
    expect(talker_state).to_have_text("SLEEPING", timeout=UI_TIMEOUT_MS)
    event = page.locator('#events li[data-stage="talker"][data-command="sleep"]').first
    expect(event).to_contain_text("ok -> SLEEPING", timeout=UI_TIMEOUT_MS)
    expect(page.locator('section[data-stage="talker"] tr[data-rank="0"] td[data-tag="weights"]')).to_have_text(
        "0 B", timeout=UI_TIMEOUT_MS)
    meta = page.locator('section[data-stage="talker"] .meta')
    expect(meta).to_contain_text("host offloaded 4.0 MiB")  # 2 ranks x 2 MiB of weights

    assert served.client.post("/v1/stages/talker/wake").status_code == 200
    expect(talker_state).to_have_text("RUNNING", timeout=UI_TIMEOUT_MS)
    expect(page.locator('section[data-stage="decoder"] [data-field="state"]')).to_have_text("RUNNING")
    assert errors == []
    page.close()


def test_the_page_asks_for_the_key(served: Served, browser: object) -> None:
    expect = sync_api.expect
    config = make_config(stage_table("talker", ranks=2, queue_limit=2), stage_table("decoder"))
    with serving(config, api_key=API_KEY, engine=served.engine) as keyed:
        page = browser.new_page()  # type: ignore[attr-defined]
        page.goto(keyed.url + "/")
        expect(page.locator("#conn")).to_have_text("API key needed", timeout=UI_TIMEOUT_MS)
        expect(page.locator("section[data-stage]")).to_have_count(0)  # nothing shown without the key
        page.fill("#key", API_KEY)
        page.click("#key-save")
        expect(page.locator("#conn")).to_have_text("live", timeout=UI_TIMEOUT_MS)
        expect(page.locator('section[data-stage="decoder"] [data-field="state"]')).to_have_text(
            "RUNNING", timeout=UI_TIMEOUT_MS)
        page.close()
