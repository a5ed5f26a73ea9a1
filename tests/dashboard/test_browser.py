"""End to end in a real browser: a real ``manage.py serve`` and a real
``manage.py ingest`` on the test Redis, Debian's headless Chromium driven by Playwright, KV events
published over ZeroMQ, a gateway's ``/metrics`` served over HTTP. What a person would see: log in
through the admin login, read the gateways' policy, decisions and latencies (and which gateway
cannot be reached), see their prefill/decode disaggregation appear once one serves it, watch a
pod's block count change on the fleet page within 3 seconds, read the charts' legends without
pointing at them (the history ingest records, the scoring traffic the web shares), keep watching
across a web server restart, switch the charts to the last 24 hours, open the pod's page."""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import zmq
from playwright.sync_api import expect, sync_playwright

from ingest.events import BlockRemoved, encode_batch, encode_message
from tests.dashboard.conftest import Process, prepare_site, unreachable_url
from tests.events import stored_event
from tests.ingest.conftest import MODEL
from tests.servers import free_port, service_env

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
# What this machine's Chromium needs headless: no sandbox as root, and no background traffic to
# hosts a closed network refuses.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "e2e-password-not-secret"


def wait_for_http(url: str, *, process: Process, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            if process.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{url} did not come up; see {process.log}") from None
            time.sleep(0.1)


@pytest.fixture
def stack(tmp_path, redis_url, gateway_metrics) -> Iterator[dict]:
    """Web (``manage.py serve``) and ingest processes sharing the test Redis (index and channel
    layer); the web reads two gateways: one served by this test, one that cannot be reached."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run `make system-deps`")
    refused = unreachable_url()
    env = service_env(
        tmp_path,
        redis_url,
        DJANGO_SUPERUSER_PASSWORD=PASSWORD,
        KVCACHE_GATEWAY_URLS=f"{gateway_metrics.url},{refused}",
    )
    prepare_site(env)
    manage = [sys.executable, "manage.py"]
    zmq_port, web_port = free_port(), free_port()
    ingest = Process(
        [*manage, "ingest", "--bind", f"tcp://127.0.0.1:{zmq_port}", "--workers", "2"],
        env,
        tmp_path / "ingest.log",
    )
    web = Process(
        # One worker: a pod's activity log lives in the memory of the worker that observed it
        # (dashboard/sampler.py), so a page served by another worker starts empty (the charts'
        # history does not: ingest records it in Redis).
        [*manage, "serve", "--port", str(web_port), "--workers", "1"],
        env,
        tmp_path / "web.log",
    )
    ingest.start()
    web.start()
    base = f"http://127.0.0.1:{web_port}"
    try:
        wait_for_http(base + "/admin/login/", process=web)
        yield {
            "base": base,
            "endpoint": f"tcp://127.0.0.1:{zmq_port}",
            "web": web,
            "ingest": ingest,
            "gateway": gateway_metrics,
            "refused": refused,
        }
    finally:
        web.stop()
        ingest.stop()


class Engine:
    """A vLLM engine's KV-event publisher for one pod."""

    def __init__(self, endpoint: str, pod: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.connect(endpoint)
        self.pod = pod
        self.seq = 0

    def send(self, events: list) -> None:
        payload = encode_batch(events, ts=time.time())
        self.socket.send_multipart(encode_message(self.pod, MODEL, self.seq, payload))
        self.seq += 1

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def check_the_gateways(page, gateway, refused: str) -> None:
    """What a kv-load gateway counted shows in its row and its decisions; the unreachable one
    says so, with no numbers."""
    counted = gateway.metrics
    up = page.locator(f'#gateways tr[data-gateway="{gateway.url}"]')
    expect(up.locator('[data-col="status"]')).to_have_text("reachable", timeout=5_000)
    expect(up.locator('[data-col="policy"]')).to_have_text("—")  # its gauge not set yet
    counted.POLICY.labels("kv-load").set(1)  # what GatewayApp does at start
    expect(up.locator('[data-col="policy"]')).to_have_text("kv-load", timeout=5_000)
    counted.REQUESTS.labels("kv-load", "sim-0", "ok").inc(7)
    counted.REQUESTS.labels("kv-load", "sim-1", "ok").inc(3)
    counted.RETRIES.labels("kv-load", "connect").inc(1)
    counted.HITS.labels("kv-load").inc(5)
    for _ in range(10):
        counted.TTFT.labels("kv-load").observe(0.3)
    expect(up.locator('[data-col="policy"]')).to_have_text("kv-load", timeout=3_000)
    expect(up.locator('[data-col="requests"]')).to_have_text("10")
    expect(up.locator('[data-col="retries"]')).to_have_text("1 (connect 1)")
    expect(up.locator('[data-col="outcomes"]')).to_have_text("ok 10")
    expect(up.locator('[data-col="ttft_overall"]')).to_have_text("375 ms / 475 ms")
    # the window's numbers: what was observed since the first scrape
    expect(up.locator('[data-col="ttft"]')).to_have_text("375 ms / 475 ms", timeout=3_000)
    expect(up.locator('[data-col="hit_rate"]')).to_have_text("50.0 % (50.0 %)")
    decision = page.locator(f'#routed tr[data-gateway="{gateway.url}"][data-pod="sim-0"]')
    expect(decision.locator('[data-col="requests"]')).to_have_text("7")
    expect(decision.locator('[data-col="share"]')).to_have_text("70.0 %")
    # no P/D request yet: no P/D table, no prefill columns
    expect(page.locator("#pd-part")).to_be_hidden()
    expect(page.locator("#routed-pd-note")).to_be_hidden()
    expect(decision.locator('[data-col="prefills"]')).to_be_hidden()

    # Prefill/decode disaggregation: 4 requests prefilled on sim-9 and decoded on sim-0, one of
    # them after sim-8's prefill step failed, one whole on sim-0 after every prefill pod failed,
    # one that sim-9 refused (a prompt too long: its answer the client's).
    counted.REQUESTS.labels("kv-load", "sim-9", "prefill_refused").inc(1)
    counted.ROUTING.pd_requests.labels("disaggregated").inc(4)
    counted.ROUTING.pd_requests.labels("fallback").inc(1)
    counted.ROUTING.pd_fallbacks.labels("connect").inc(1)
    counted.PD_PREFILLS.labels("sim-9", "ok").inc(4)
    counted.PD_PREFILLS.labels("sim-9", "refused").inc(1)
    counted.PD_PREFILLS.labels("sim-8", "connect").inc(2)
    for _ in range(4):
        counted.PD_STEP.labels("prefill").observe(0.3)
        counted.PD_STEP.labels("transfer").observe(0.02)
    pd = page.locator(f'#pd-gateways tr[data-gateway="{gateway.url}"]')
    expect(pd.locator('[data-col="disaggregated"]')).to_have_text("4", timeout=5_000)
    expect(page.locator("#pd-part")).to_be_visible()
    expect(pd.locator('[data-col="short_prompt"]')).to_have_text("0")
    expect(pd.locator('[data-col="fallback"]')).to_have_text("1")
    expect(pd.locator('[data-col="disaggregated_per_s"]')).not_to_have_text("—")  # over the window
    expect(pd.locator('[data-col="fallback_per_s"]')).to_have_class("num bad")
    expect(pd.locator('[data-col="fallbacks_by_reason"]')).to_have_text("connect 1")
    # all observed in the window: the same p50 over it and since start
    expect(pd.locator('[data-col="prefill_p50"]')).to_have_text("375 ms (375 ms)")
    expect(pd.locator('[data-col="transfer_p50"]')).to_have_text("18 ms (18 ms)")
    expect(page.locator(f'#pd-gateways tr[data-gateway="{refused}"]')).to_have_count(0)  # no P/D known

    expect(page.locator("#routed-pd-note")).to_be_visible()
    prefill = page.locator(f'#routed tr[data-gateway="{gateway.url}"][data-pod="sim-9"]')
    expect(prefill.locator('[data-col="prefills"]')).to_have_text("5 (refused 1)")
    expect(prefill.locator('[data-col="prefills"]')).to_have_class("num pd-only")  # a refusal: not bad
    expect(prefill.locator('[data-col="prefills_per_s"]')).not_to_have_text("—")
    failing = page.locator(f'#routed tr[data-gateway="{gateway.url}"][data-pod="sim-8"]')
    expect(failing.locator('[data-col="prefills"]')).to_have_text("2 (connect 2)")
    expect(failing.locator('[data-col="prefills"]')).to_have_class("num pd-only bad")
    expect(decision.locator('[data-col="prefills"]')).to_have_text("—")  # sim-0 only decodes
    expect(decision.locator('[data-col="requests"]')).to_have_text("7")

    down = page.locator(f'#gateways tr[data-gateway="{refused}"]')
    expect(down.locator('[data-col="status"]')).to_contain_text("unreachable")
    expect(down.locator('[data-col="status"]')).to_contain_text("ConnectError")
    expect(down.locator('[data-col="requests"]')).to_have_text("—")
    expect(page.locator("#gateways-empty")).to_be_hidden()


def legend_value(page, chart: str, series: str):
    """The value a chart's legend shows for one series (uPlot's legend table)."""
    return page.locator(f"#{chart} .u-legend tr.u-series", has_text=series).first.locator(".u-value")


def check_the_legends(page) -> None:
    """Each legend shows the latest values as soon as there are points, with no pointer over
    the chart: the pod's blocks, events per second, and the scoring requests the gateway routed
    (shared by the web, recorded by ingest)."""
    page.mouse.move(0, 0)
    expect(legend_value(page, "chart-blocks", "pod-e2e")).to_have_text("25", timeout=5_000)
    expect(legend_value(page, "chart-traffic", "events/s")).not_to_have_text("—")
    expect(legend_value(page, "chart-traffic", "scoring requests/s")).not_to_have_text("—", timeout=5_000)


def test_a_pod_s_blocks_change_on_screen_within_3_seconds(stack, base_capture, tmp_path):
    engine = Engine(stack["endpoint"], "pod-e2e")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            page.goto(stack["base"] + "/dashboard/")
            expect(page).to_have_url(f"{stack['base']}/admin/login/?next=/dashboard/")
            page.fill("#id_username", "ops")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            expect(page).to_have_url(stack["base"] + "/dashboard/")
            connection = page.locator("#connection")
            expect(connection).to_have_text("Live", timeout=10_000)
            check_the_gateways(page, stack["gateway"], stack["refused"])

            # ZeroMQ drops what a PUB sends before its subscription arrives: warm up with empty
            # batches until the pod shows up on the page.
            row = page.locator('tr[data-pod="pod-e2e"]')
            deadline = time.monotonic() + 20
            while not row.count():
                assert time.monotonic() < deadline, "the pod never appeared"
                engine.send([])
                page.wait_for_timeout(200)
            blocks = row.locator('[data-col="blocks"]')
            expect(blocks).to_have_text("0")

            engine.send([stored_event(base_capture)])
            started = time.monotonic()
            expect(blocks).to_have_text("25", timeout=3_000)
            assert time.monotonic() - started < 3.0
            expect(row.locator('[data-col="hash_alignment"]')).to_have_text("100.0 %", timeout=3_000)
            expect(row.locator('[data-col="status"]')).to_have_text("active")
            expect(page.locator('[data-total="blocks"]')).to_contain_text("25")
            check_the_legends(page)

            page.fill("#pod-filter", "no-such-pod")
            expect(row).to_be_hidden()
            page.fill("#pod-filter", "e2e")
            expect(row).to_be_visible()

            # The web server restarts: the page reconnects by itself and keeps updating.
            stack["web"].stop()
            expect(connection).not_to_have_text("Live", timeout=10_000)
            stack["web"].start()
            expect(connection).to_have_text("Live", timeout=20_000)
            engine.send([BlockRemoved(block_hashes=tuple(base_capture["block_hashes"][20:25]), tier="gpu")])
            started = time.monotonic()
            expect(blocks).to_have_text("20", timeout=3_000)
            assert time.monotonic() - started < 3.0

            page.select_option("#chart-span", "86400")  # the 24-hour level, then live points
            expect(legend_value(page, "chart-blocks", "pod-e2e")).to_have_text("20", timeout=5_000)

            row.locator("a").click()
            expect(page).to_have_url(stack["base"] + "/dashboard/pods/pod-e2e/")
            expect(page.locator('[data-field="blocks"]')).to_have_text("20", timeout=5_000)
            expect(legend_value(page, "chart-pod", "blocks")).to_have_text("20", timeout=5_000)
            expect(page.locator("#pod-log tbody tr").first).to_be_visible(timeout=5_000)
            assert errors == []
        finally:
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
            engine.close()
