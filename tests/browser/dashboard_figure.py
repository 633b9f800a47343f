"""Chapter 13's dashboard figure: ``/dashboard`` in Chromium, mid-run, as a PNG.

    .venv/bin/python tests/browser/dashboard_figure.py [--out figures/serving_dashboard.png]

The server runs in a thread of this process on a free port, over an engine with 48 blocks of 4
tokens. A first request runs to its end (its full blocks stay cached); then two streaming
requests that share a prefix run, and once each has streamed a few chunks the engine thread is
parked between steps, so the page shows one consistent state: cached, held and shared blocks,
the free queue, the hash index and the running requests. The browser is Debian's Chromium,
handed to playwright as ``executable_path`` (never a downloaded one), as in the browser tests.
``test_browser_dashboard.py`` runs this too (into a temporary folder) so that it keeps working.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

from course_pkg.engine.async_llm import AsyncLLM  # noqa: E402
from course_pkg.serve import ServerThread, build_app  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE = 48, 4
SHARED = "The block manager keeps a pool of fixed-size blocks and"


def take(out: Path, browser) -> Path:
    """Write the picture to ``out`` with ``browser`` (a playwright Browser)."""
    from playwright.sync_api import expect

    llm = AsyncLLM(device="cpu", num_kvcache_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner = llm.engine.model_runner
    execute_model = runner.execute_model

    def slow_step(o):   # 20 ms a step: the streams last long enough to be caught mid-run
        time.sleep(0.02)
        return execute_model(o)
    runner.execute_model = slow_step
    gate, parked = threading.Event(), threading.Event()
    try:
        with ServerThread(build_app(llm)) as server:
            httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": "A prefix cache hit needs a full block", "max_tokens": 6, "temperature": 0})
            page = browser.new_page(viewport={"width": 1240, "height": 420})
            page.goto(server.url + "/dashboard")
            expect(page.locator("#status")).to_have_text("live", timeout=30_000)

            def stream(suffix: str, chunks_before_park: int):
                body = {"prompt": SHARED + suffix, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                    seen = 0
                    for line in r.iter_lines():
                        seen += line.startswith("data:")
                        if seen == chunks_before_park and not parked.is_set():
                            parked.set()
                            llm.call_in_engine_thread_nowait(lambda engine, live: gate.wait(30))
                        if seen == chunks_before_park + 2:
                            return   # leaving aborts it (after the picture)
            clients = [threading.Thread(target=stream, args=(s, 12)) for s in (" one", " two")]
            for c in clients:
                c.start()
            parked.wait(30)
            time.sleep(0.3)   # the last snapshot before the park reaches the page
            expect(page.locator("#n-running")).to_have_text("2", timeout=30_000)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
            gate.set()
            for c in clients:
                c.join(60)
            page.close()
    finally:
        gate.set()
        llm.shutdown()
    return out


def main() -> None:
    from playwright.sync_api import sync_playwright

    from conftest import find_chromium
    from labdriver import CHROMIUM_ARGS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "figures" / "serving_dashboard.png"))
    args = parser.parse_args()
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("no Chromium: install Debian's chromium (tools/ensure_chromium.sh)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS)
        try:
            print("wrote", take(Path(args.out), browser))
        finally:
            browser.close()


if __name__ == "__main__":
    main()
