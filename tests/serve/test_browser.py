"""The live status page in a real browser: headless Chromium (Debian's) driven by Playwright.
A sleep issued through the API must show on the page without a reload."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from omni_core.fsm import StageState
from tests.serve.conftest import (
    API_KEY,
    PROBE,
    Served,
    make_config,
    metric_value,
    serving,
    stage_table,
    wait_for,
)

CHROMIUM = os.environ.get("OMNI_CORE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
UI_TIMEOUT_MS = 30_000  # the page updates within ~0.5 s; the bound only turns a hang into a failure
REBOUND = "rebound.test"

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
if not os.path.exists(CHROMIUM):
    if os.environ.get("OMNI_CORE_REQUIRE_BROWSER"):
        raise RuntimeError(
            f"no Chromium at {CHROMIUM}: `apt-get install -y chromium` (Debian) or set OMNI_CORE_CHROMIUM"
        )
    pytest.skip(
        f"no Chromium at {CHROMIUM} (apt-get install -y chromium; OMNI_CORE_REQUIRE_BROWSER=1 makes this an error)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as pw:
        # rebound.test resolves to loopback in this browser only: a DNS rebinding without DNS
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"],
        )
        yield browser
        browser.close()


pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


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
        "0 B", timeout=UI_TIMEOUT_MS
    )
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
            "RUNNING", timeout=UI_TIMEOUT_MS
        )
        page.close()


# A page of another origin that tries what a no-cors fetch allows: POSTs without a body, with
# text/plain, with a form, with a typeless Blob holding JSON. Each answer is opaque to the page;
# only the server's state says whether one of them worked.
ATTACK_PAGE = """<!doctype html><title>attack</title><script>
const target = %s;
const posts = [
  ["/sleep?level=1", {}],
  ["/v1/stages/talker/restart", {}],
  ["/v1/stages/decoder/restart", {body: "{}"}],
  ["/v1/omni/sleep", {body: JSON.stringify({stage_ids: [0, 1], level: 2})}],
  ["/v1/stages/decoder/sleep", {body: new Blob([JSON.stringify({level: 2})])}],
  ["/v1/stages/talker/sleep", {body: new URLSearchParams({level: "2"})}],
  ["/v1/stages/decoder/restart", {body: new FormData()}],
];
Promise.allSettled(posts.map(([path, init]) =>
    fetch(target + path, {mode: "no-cors", method: "POST", credentials: "include", ...init})))
  .then(results => { document.title = "sent " + results.length; });
</script>"""


@contextlib.contextmanager
def other_origin(page_html: str) -> Iterator[str]:
    """A second HTTP server on another port (so another origin) serving one page."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page_html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _states(served: Served) -> dict[str, tuple[str, int]]:
    return {s["name"]: (s["state"], s["epoch"]) for s in served.client.get("/v1/stages").json()["stages"]}


def test_a_page_of_another_origin_changes_nothing(served: Served, browser: object) -> None:
    before = _states(served)
    refused_before = sum(
        metric_value(served.client.get("/metrics").text, "omni_core_http_requests_refused_total", reason=r)
        for r in ("origin", "content_type")
    )
    with other_origin(ATTACK_PAGE % json.dumps(served.url)) as attacker:
        page = browser.new_page()  # type: ignore[attr-defined]
        page.goto(attacker)
        sync_api.expect(page).to_have_title("sent 7", timeout=UI_TIMEOUT_MS)
        page.close()
    refused = sum(
        metric_value(served.client.get("/metrics").text, "omni_core_http_requests_refused_total", reason=r)
        for r in ("origin", "content_type")
    )
    assert refused - refused_before == 7  # every POST reached the server and was refused
    assert _states(served) == before  # no sleep, no restart (a restart would raise the epoch)


def test_a_rebound_name_is_refused(served: Served, browser: object) -> None:
    port = served.url.rsplit(":", 1)[1]
    page = browser.new_page()  # type: ignore[attr-defined]
    answer = page.goto(f"http://{REBOUND}:{port}/v1/stages")
    assert answer is not None and answer.status == 403 and "ForeignHost" in answer.text()
    assert page.goto(f"{served.url}/v1/stages").status == 200  # the same server under its own name
    page.close()


def test_the_page_runs_under_its_content_security_policy(served: Served, browser: object) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    violations: list[str] = []
    page.on("console", lambda msg: violations.append(msg.text) if "Content Security Policy" in msg.text else None)
    answer = page.goto(served.url + "/")
    assert "script-src 'sha256-" in answer.headers["content-security-policy"]
    assert answer.headers["x-frame-options"] == "DENY"
    sync_api.expect(page.locator("#conn")).to_have_text("live", timeout=UI_TIMEOUT_MS)  # the script ran
    sync_api.expect(page.locator('section[data-stage="talker"] [data-field="state"]')).to_have_text(
        "RUNNING", timeout=UI_TIMEOUT_MS
    )
    assert violations == []
    page.close()


def test_the_page_loads_without_a_failed_request_and_reads_at_420_px(served: Served, browser: object) -> None:
    """No request of the page fails (the browser's favicon fetch was a 404 in every console),
    and on a 420 px wide screen nothing runs off the side: wide tables scroll in their box."""
    page = browser.new_page(viewport={"width": 420, "height": 900})  # type: ignore[attr-defined]
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.on("requestfailed", lambda r: failed.append(f"failed {r.url}"))
    page.goto(served.url + "/")
    sync_api.expect(page.locator('section[data-stage="talker"] [data-field="state"]')).to_have_text(
        "RUNNING", timeout=UI_TIMEOUT_MS
    )
    assert page.locator('link[rel="icon"]').count() == 1
    assert failed == []
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px window"
    page.close()


def test_a_failed_stage_is_a_banner_its_rank_death_an_event_and_mistakes_stand_apart(
    served: Served, browser: object
) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    page.goto(served.url + "/")
    sync_api.expect(page.locator("#conn")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    assert page.locator("#banner").is_hidden()
    refused = served.client.post("/v1/stages/talker/sleep", json={"level": 7})  # the caller's mistake
    assert refused.status_code in (400, 422), refused.text
    bad_level = served.client.post("/v1/stages/talker/wake", json={"tags": ["no-such-tag"]})
    assert 400 <= bad_level.status_code < 500, bad_level.text
    mistake = page.locator('#events li[data-stage="talker"][data-command="wake"]').filter(has_text="no-such-tag")
    sync_api.expect(mistake).to_have_attribute("data-kind", "mistake", timeout=UI_TIMEOUT_MS)
    sync_api.expect(mistake).to_contain_text("refused: the caller's request")
    pid = served.engine.status()["decoder"]["ranks"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    banner = page.locator('#banner div[data-stage="decoder"]')
    sync_api.expect(banner).to_contain_text("stage decoder is FAILED", timeout=UI_TIMEOUT_MS)
    sync_api.expect(banner).to_contain_text("omni-core restart decoder")
    # Other tests of the session may have killed a rank of this stage before: this one's pid.
    gone = page.locator('#events li[data-stage="decoder"][data-command="rank_gone"]').filter(
        has_text=f"rank 0 (pid {pid}) exited"
    )
    sync_api.expect(gone).to_have_attribute("data-kind", "bad", timeout=UI_TIMEOUT_MS)
    served.settle("decoder")  # a restart: the banner goes
    sync_api.expect(page.locator("#banner")).to_be_hidden(timeout=UI_TIMEOUT_MS)
    page.close()


PLOT_TOP, PLOT_BOTTOM = 10.0, 190.0  # the memory chart's plot area in its viewBox (page.py's PLOT)


def _series_end_y(page: object, stage: str) -> float:
    """The height at which the stage's line ends (now): the y of its last `M x y` move."""
    d = page.locator(f'#memory-chart path.series[data-stage="{stage}"]').get_attribute("d")  # type: ignore[attr-defined]
    return float(re.findall(r"M[\d.]+ ([\d.]+)", d)[-1])


def _axis_top_bytes(page: object) -> int:
    return max(int(t.get_attribute("data-bytes")) for t in page.locator("#memory-chart text.y-tick").all())  # type: ignore[attr-defined]


def test_the_memory_chart_follows_a_sleep_and_a_wake(served: Served, browser: object) -> None:
    """The chart's line for the talker drops to the byte axis' 0 on a level-1 sleep (every
    pool released) and climbs back to the bytes the ranks report after the wake; the legend
    names each stage with its bytes and each state strip color; the time axis spans the last
    five minutes, oldest left."""
    expect = sync_api.expect
    page = browser.new_page()  # type: ignore[attr-defined]
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(served.url + "/")
    expect(page.locator("#conn")).to_have_text("live", timeout=UI_TIMEOUT_MS)

    states = page.locator("#state-legend li[data-state]")
    # A colour for every state of the table, and one for a stage not heard from yet.
    expect(states).to_have_count(len(StageState) + 1)
    assert {s.get_attribute("data-state") for s in states.all()} == {s.value for s in StageState} | {"UNKNOWN"}
    ticks = page.locator("#memory-chart text.x-tick")
    expect(ticks).to_have_count(6)
    # Read in one go: the chart is drawn again at every feed update, so ticks read one by one
    # may come from two drawings.
    times = page.eval_on_selector_all("#memory-chart text.x-tick", "ticks => ticks.map(t => +t.dataset.time)")
    assert times == sorted(times) and times[-1] - times[0] == pytest.approx(300_000, abs=2)
    assert all(re.search(r"\d{1,2}:\d{2}:\d{2}", t.text_content() or "") for t in ticks.all())

    talker = page.locator('#memory-chart path.series[data-stage="talker"]')
    assert served.client.post("/v1/stages/talker/sleep", json={"level": 1}).status_code == 200
    expect(talker).to_have_attribute("data-bytes", "0", timeout=UI_TIMEOUT_MS)
    expect(page.locator('#memory-legend li[data-stage="talker"]')).to_have_text("talker 0 B")
    assert _series_end_y(page, "talker") == PLOT_BOTTOM  # on the axis' 0
    assert _axis_top_bytes(page) > 0  # the bytes before the sleep are on the chart too

    assert served.client.post("/v1/stages/talker/wake").status_code == 200
    ranks = served.stage("talker")["ranks"].values()
    resident = sum(sum(r["pool_bytes"].values()) for r in ranks)
    assert resident > 0
    expect(talker).to_have_attribute("data-bytes", str(resident), timeout=UI_TIMEOUT_MS)
    top = _axis_top_bytes(page)
    expected_y = PLOT_BOTTOM - resident / top * (PLOT_BOTTOM - PLOT_TOP)
    assert _series_end_y(page, "talker") == pytest.approx(expected_y, abs=0.1)
    expect(page.locator('#memory-legend li[data-stage="talker"]')).to_contain_text("MiB")
    assert errors == []
    page.close()


def test_a_fresh_server_shows_memory_and_runner_counters_before_any_call(browser: object) -> None:
    """Started, nothing called yet: the legend gives each stage's bytes (from the ranks'
    Hellos), not "not measured yet"; the rank table has every tag's bytes; the runner's own
    counters are listed under its table once a request ran."""
    expect = sync_api.expect
    table = stage_table("counted", runner="tests.serve.counting_runner:CountingRunner")
    with serving(make_config(table)) as fresh:
        page = browser.new_page()  # type: ignore[attr-defined]
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(fresh.url + "/")
        expect(page.locator("#conn")).to_have_text("live", timeout=UI_TIMEOUT_MS)
        pools = fresh.stage("counted")["ranks"]["0"]["pool_bytes"]
        series = page.locator('#memory-chart path.series[data-stage="counted"]')
        expect(series).to_have_attribute("data-bytes", str(sum(pools.values())), timeout=UI_TIMEOUT_MS)
        legend = page.locator('#memory-legend li[data-stage="counted"]')
        expect(legend).to_contain_text("MiB")
        expect(legend).not_to_contain_text("not measured yet")
        weights = page.locator('section[data-stage="counted"] tr[data-rank="0"] td[data-tag="weights"]')
        expect(weights).to_contain_text("MiB")
        counters = page.locator('section[data-stage="counted"] [data-field="runner_counters"]')
        expect(counters).to_have_text("runner counters: always_zero 0 · requests_run 0")
        fresh.engine.execute("counted", PROBE)
        fresh.engine.execute("counted", PROBE)
        expect(counters).to_have_text("runner counters: always_zero 0 · requests_run 2", timeout=UI_TIMEOUT_MS)
        wait_for(
            lambda: (
                metric_value(
                    fresh.client.get("/metrics").text,
                    "omni_core_runner_events_total",
                    stage="counted",
                    counter="requests_run",
                )
                == 2
            ),
            what="requests_run in /metrics",
        )
        assert errors == []
        page.close()


def test_the_page_lists_a_stages_adapters_and_where_they_are(served: Served, browser: object) -> None:
    """P-20: name, version, base version, pinned, and resident -> offloaded at a level-1 sleep."""
    expect = sync_api.expect
    served.engine.add_adapter("decoder", "sql", "seed:7", rank=4, target_modules=("w0",), pinned=True)
    try:
        page = browser.new_page()  # type: ignore[attr-defined]
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(served.url + "/")
        row = page.locator('section[data-stage="decoder"] table[data-field="adapters"] tr[data-adapter="sql"]')
        expect(row.locator('td[data-col="residency"]')).to_have_text("resident", timeout=UI_TIMEOUT_MS)
        expect(row.locator('td[data-col="version"]')).to_have_text("v1")
        expect(row.locator('td[data-col="base_version"]')).to_have_text("v0")
        expect(row.locator('td[data-col="pinned"]')).to_have_text("pinned")
        assert served.client.post("/v1/stages/decoder/sleep", json={"level": 1}).status_code == 200
        expect(row.locator('td[data-col="residency"]')).to_have_text("offloaded", timeout=UI_TIMEOUT_MS)
        assert served.client.post("/v1/stages/decoder/wake").status_code == 200
        expect(row.locator('td[data-col="residency"]')).to_have_text("resident", timeout=UI_TIMEOUT_MS)
        assert errors == []
        page.close()
    finally:
        served.engine.remove_adapter("decoder", "sql")
