"""The dashboard in a real browser: Playwright driving the system Chromium.

A server on the tiny model (each step slowed by 15 ms, so a short request
lasts long enough to watch) serves ``/dashboard``; the test sends requests
and reads what the page drew: the grid's counts of held and free blocks
(kept on the canvas as data attributes), the request rows, the step bars.
The replay test records a real trace and steps through it with the page's
controls. Screenshots go to the test's temporary folder and must not be
blank. Chromium comes from the system (Debian's ``chromium`` package, which
``make test`` installs when it is missing); Playwright never downloads one.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from kvserve import LLM, SamplingParams
from kvserve.dashboard.replay_app import build_replay_app
from kvserve.trace import TraceFile

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no system Chromium (Debian: apt-get install chromium; make test does)"
)
TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    # The page's CSP forbids eval, which Playwright's wait_for_function uses.
    context = browser.new_context(bypass_csp=True, viewport={"width": 1400, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    context.close()  # closes the page's event stream before the server stops
    assert errors == [], errors


# Seconds added to every step; a test that must watch requests run raises it for a while.
STEP_DELAY_S = {"now": 0.015}


@pytest.fixture(scope="module")
def server(start_tiny_server: Any) -> Any:
    server = start_tiny_server(engine_args={"max_num_batched_tokens": 128, "max_num_seqs": 8})
    engine = server.async_engine.engine
    step = type(engine).step

    def slow_step() -> Any:
        threading.Event().wait(STEP_DELAY_S["now"])
        return step(engine)

    engine.step = slow_step
    return server


def grid_count(page: Any, name: str) -> int:
    return int(page.get_attribute("#grid", f"data-{name}"))


def assert_not_blank(png: bytes) -> None:
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float64)
    assert pixels.std() > 10, "the screenshot is (nearly) one colour"


def test_the_grid_fills_while_requests_run_and_empties_after(
    server: Any, page: Any, tmp_path: Path
) -> None:
    num_blocks = server.async_engine.engine.kv_cache_manager.num_usable_blocks
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("#status[data-state=live]", timeout=TIMEOUT_MS)
    page.wait_for_function("document.getElementById('grid').dataset.free !== undefined")
    assert grid_count(page, "owned") == 0 and grid_count(page, "free") == num_blocks

    # Four streams that run until the test closes them (at 100 ms a step, 70 tokens
    # would take over 7 s), so the page has time to show them however slow it is.
    STEP_DELAY_S["now"] = 0.1
    try:
        with contextlib.ExitStack() as streams:
            client = streams.enter_context(httpx.Client(timeout=60))
            for words in (4, 10, 16, 22):
                body = {"model": "tiny", "prompt": "paged blocks " * words, "max_tokens": 70}
                body |= {"ignore_eos": True, "stream": True}
                url = f"{server.url}/v1/completions"
                response = streams.enter_context(client.stream("POST", url, json=body))
                assert response.status_code == 200
            watch_the_busy_grid(page, tmp_path)
    finally:
        STEP_DELAY_S["now"] = 0.015
    # The streams are closed: the requests are aborted and free their blocks.
    page.mouse.move(0, 0)
    page.wait_for_function(
        "Number(document.getElementById('grid').dataset.owned) === 0", timeout=TIMEOUT_MS
    )
    assert grid_count(page, "free") == num_blocks
    assert page.locator("#requests tbody tr").count() == 0


def watch_the_busy_grid(page: Any, tmp_path: Path) -> None:
    """The page while requests run: held blocks, decoding rows, step bars, a highlight."""
    page.wait_for_function(
        "Number(document.getElementById('grid').dataset.owned) > 0", timeout=TIMEOUT_MS
    )
    page.wait_for_selector("#requests tbody tr[data-phase=decoding]", timeout=TIMEOUT_MS)
    page.wait_for_selector("#steps rect.decode", timeout=TIMEOUT_MS)
    page.wait_for_selector("#steps rect.prefill", timeout=TIMEOUT_MS)
    # Hovering a request highlights its blocks in the grid.
    row = page.locator("#requests tbody tr").first
    request_id = row.get_attribute("data-request-id")
    row.hover()
    assert page.get_attribute("#grid", "data-highlight") == request_id
    png = page.screenshot(path=str(tmp_path / "dashboard-busy.png"))
    assert_not_blank(png)


def test_the_load_button_starts_a_load_the_grid_shows(server: Any, page: Any) -> None:
    server.wait_idle()
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("#status[data-state=live]", timeout=TIMEOUT_MS)
    page.click("#send-load")
    page.wait_for_function(
        "Number(document.getElementById('grid').dataset.owned) > 0", timeout=TIMEOUT_MS
    )
    assert page.is_disabled("#send-load")
    assert "load:" in page.inner_text("#load-status")
    page.wait_for_function("!document.getElementById('send-load').disabled", timeout=60_000)
    assert "last load: 12 requests" in page.inner_text("#load-status")


def test_the_replay_controls_step_through_a_recorded_trace(
    tiny_model_dir: Path, start_server: Any, page: Any, tmp_path: Path
) -> None:
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        block_size=4,
        num_blocks=40,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    path = tmp_path / "trace.jsonl"
    with TraceFile(path) as trace:
        llm.llm_engine.set_trace(trace)
        prompts = [{"prompt_token_ids": list(range(20 + i, 50 + 4 * i))} for i in range(4)]
        llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.set_trace(None)
    replay = start_server(build_replay_app(path))
    page.goto(f"{replay.url}/dashboard")
    page.wait_for_selector("#status[data-state=replay]", timeout=TIMEOUT_MS)
    page.wait_for_selector("#replay-position[data-index='0']", timeout=TIMEOUT_MS)
    total = int(page.get_attribute("#replay-seek", "max")) + 1
    assert total > 10
    assert grid_count(page, "owned") > 0  # the first step already holds a prompt's blocks
    page.click("#replay-step")
    page.wait_for_selector("#replay-position[data-index='1']")
    page.click("#replay-back")
    page.wait_for_selector("#replay-position[data-index='0']")
    page.select_option("#replay-speed", "16")
    page.click("#replay-play")
    page.wait_for_function(
        f"document.getElementById('replay-position').dataset.index === '{total - 1}'",
        timeout=TIMEOUT_MS,
    )
    assert page.inner_text("#replay-play") == "Play"  # it paused at the end
    assert grid_count(page, "owned") == 0 and page.locator("#steps rect").count() > 0
    assert_not_blank(page.screenshot(path=str(tmp_path / "dashboard-replay.png")))


def test_with_an_api_key_the_page_asks_for_it_and_runs_with_it_in_the_fragment(
    start_tiny_server: Any, page: Any
) -> None:
    key = "a+b/c=="  # characters a URL query would mangle
    keyed = start_tiny_server(api_keys=(key,))
    page.goto(f"{keyed.url}/dashboard")
    page.wait_for_selector("#key-form", state="visible", timeout=TIMEOUT_MS)
    assert page.get_attribute("#status", "data-state") == "error"
    page.fill("#key-input", key)
    page.click("#key-form button")
    page.wait_for_selector("#status[data-state=live]", timeout=TIMEOUT_MS)
    page.wait_for_function("document.getElementById('grid').dataset.free !== undefined")
    num_blocks = keyed.async_engine.engine.kv_cache_manager.num_usable_blocks
    assert grid_count(page, "free") == num_blocks


def test_speculation_and_disk_tier_tiles_show_only_when_the_engine_has_them(
    server: Any, start_tiny_server: Any, page: Any, tmp_path: Path
) -> None:
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("#stats dt", timeout=TIMEOUT_MS)
    assert page.locator("#stats [data-tile]").count() == 0  # neither is on

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    engine_args = {"speculative_config": {**spec, "adaptive": False}}
    both = start_tiny_server(engine_args={**engine_args, "prefix_cache_dir": str(tmp_path)})
    # Greedy on a prompt that repeats itself: the n-gram lookup finds proposals.
    body = {"model": "tiny", "prompt": "abc abc abc abc abc abc abc abc", "max_tokens": 40}
    body |= {"temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{both.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    both.wait_idle()
    # The finished request's blocks go to disk on the tier's writer thread: wait for them.
    both.async_engine.engine.disk_tier.flush()
    stats = both.async_engine.engine.stats
    assert stats.num_spec_proposed_tokens > 0 and stats.disk_tier is not None
    page.goto(f"{both.url}/dashboard")
    page.wait_for_selector("#stats [data-tile=spec-total]", timeout=TIMEOUT_MS)
    proposed, accepted = stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens
    total = page.inner_text("#stats [data-tile=spec-total] dd")
    assert total.startswith(f"{proposed} · {accepted}")
    assert "adaptive policy off" in page.inner_text("#stats [data-tile=spec-declined]")
    writes = stats.disk_tier.counters.writes
    assert writes > 0
    assert f"0 · {writes}" in page.inner_text("#stats [data-tile=disk-tier] dd")
    hits = page.inner_text("#stats [data-tile=cache-hits] dd")
    assert hits.startswith(f"{stats.prefix_cache_hits}")
