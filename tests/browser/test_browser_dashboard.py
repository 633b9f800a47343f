"""Chapter 13's live dashboard in Chromium: it opens, draws the pool, and changes as a request streams.

The server runs in a thread of this process (``ServerThread``) on a free port; the page is the
one ``/dashboard`` serves (no CDN: every request it makes must stay on this server).
"""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from playwright.sync_api import expect

from course_pkg.engine.async_llm import AsyncLLM
from course_pkg.serve import ServerThread, build_app

NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM(device="cpu", num_kvcache_blocks=NUM_BLOCKS, block_size=4)
    runner = llm.engine.model_runner
    execute_model = runner.execute_model

    def slow_step(out):   # 20 ms a step: a request runs long enough for the page to see it
        time.sleep(0.02)
        return execute_model(out)
    runner.execute_model = slow_step
    with ServerThread(build_app(llm)) as server:
        yield server
    llm.shutdown()


def test_dashboard_draws_the_pool_and_follows_a_streaming_request(browser, server, shots):
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    page = context.new_page()
    errors, remote = [], []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda req: None if req.url.startswith(server.url) else remote.append(req.url))
    try:
        page.goto(server.url + "/dashboard")
        expect(page.locator("#status")).to_have_text("live")
        blocks = page.locator("#pool .block")
        expect(blocks).to_have_count(NUM_BLOCKS)
        expect(page.locator('#pool .block[data-state="free"]')).to_have_count(NUM_BLOCKS)
        expect(page.locator("#free-queue")).to_contain_text(re.compile(r"^0 1 2 3 "))
        expect(page.locator("#hash-index")).to_have_text("(empty)")
        step_before = int(page.locator("#step").inner_text())

        # A streaming request of 120 tokens: 120 steps of 20 ms at least.
        body = {"prompt": "The block manager keeps", "max_tokens": 120, "ignore_eos": True, "stream": True}
        chunks = []

        def client():
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                chunks.extend(line for line in r.iter_lines() if line.startswith("data:"))
        thread = threading.Thread(target=client)
        thread.start()
        # While it runs: a block held by it, its row in the running table with its block table.
        expect(page.locator('#pool .block[data-state="exclusive"]').first).to_be_visible()
        expect(page.locator("#running tbody tr")).to_have_count(1)
        expect(page.locator("#n-running")).to_have_text("1")
        page.screenshot(path=shots / "dashboard-while-streaming.png")
        thread.join(60)
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 100
        # Afterwards: nothing held, the prompt's full blocks still cached (in the hash index).
        expect(page.locator("#n-running")).to_have_text("0")
        expect(page.locator('#pool .block[data-state="exclusive"]')).to_have_count(0)
        expect(page.locator('#pool .block[data-state="cached"]').first).to_be_visible()
        expect(page.locator("#hash-index")).not_to_have_text("(empty)")
        assert int(page.locator("#step").inner_text()) > step_before + 100
        page.screenshot(path=shots / "dashboard-after.png")
        assert not errors, errors
        assert not remote, f"the page reached outside the server: {remote}"
    finally:
        context.close()


def test_the_dashboard_figure_script_takes_its_picture(browser, shots):
    """``dashboard_figure.py`` (figures/serving_dashboard.png, shown by chapter 13) still works."""
    from dashboard_figure import take

    png = take(shots / "serving_dashboard.png", browser)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
