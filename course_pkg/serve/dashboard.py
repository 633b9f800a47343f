"""The live block dashboard (chapter 13): ``GET /dashboard`` and its feed ``/dashboard/events``.

After every engine step (and every add and abort) the engine thread takes a snapshot with the
same code the notebooks draw from -- :func:`course_pkg.viz.take_snapshot` and
``Snapshot.state`` -- adds the scheduler's running and waiting queues, and sends it as one
JSON server-sent event to every open dashboard. The page (``static/dashboard.html``: no CDN,
no build step) draws it: each block with its ref count and state, the free queue head to
tail, the hash index, the requests. A slow page skips snapshots (it always gets the newest);
nothing is computed while no page is open.
"""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, StreamingResponse

from course_pkg.viz.snapshot import short_hash, take_snapshot

PAGE = Path(__file__).with_name("static") / "dashboard.html"


def dashboard_snapshot(engine, live: dict) -> dict:
    """The engine's state now, as the dashboard draws it (run on the engine thread)."""
    snap = take_snapshot(engine.block_manager, live, label=f"after step {engine.num_steps}")
    sched, metrics = engine.scheduler, engine.get_metrics()
    name_of = {id(seq): name for name, seq in live.items()}

    def row(seq):
        return [name_of.get(id(seq), f"seq {seq.seq_id}"), seq.num_tokens, seq.num_cached_tokens, seq.status.name]

    return {
        "step": engine.num_steps, "label": snap.label, "block_size": snap.block_size,
        "blocks": [[b.block_id, b.ref_count, snap.state(b.block_id), short_hash(b.hash), len(b.token_ids)]
                   for b in snap.blocks],
        "free_queue": list(snap.free_queue),
        "hash_index": [[short_hash(h), b] for h, b in snap.hash_index],
        "block_tables": [[name, list(table)] for name, table in snap.block_tables],
        "running": [row(s) for s in sched.running], "waiting": [row(s) for s in sched.waiting],
        "metrics": {"kv_cache_usage_perc": metrics.kv_cache_usage_perc,
                    "num_requests_running": metrics.num_requests_running,
                    "num_requests_waiting": metrics.num_requests_waiting,
                    "prefix_cache_hit_rate": metrics.prefix_cache_hit_rate,
                    "num_preemptions": metrics.num_preemptions, "generation_tokens": metrics.generation_tokens},
    }


class _Hub:
    """One step listener on the engine thread, fanned out to every open page."""

    def __init__(self, llm):
        self.llm, self.pages, self.lock, self.listening = llm, set(), threading.Lock(), False

    def on_step(self, engine, live) -> None:          # engine thread
        with self.lock:
            pages = list(self.pages)
        if not pages:
            return
        data = json.dumps(dashboard_snapshot(engine, live), separators=(",", ":"))
        for page in pages:
            page.offer(data)

    def join(self, page) -> None:
        with self.lock:
            self.pages.add(page)
            first = not self.listening
            self.listening = True
        if first:
            self.llm.add_step_listener(self.on_step)
        else:
            self.llm.call_in_engine_thread_nowait(lambda engine, live: page.offer(
                json.dumps(dashboard_snapshot(engine, live), separators=(",", ":"))))

    def leave(self, page) -> None:
        with self.lock:
            self.pages.discard(page)


class _Page:
    """One open dashboard: keeps only the newest snapshot."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.latest: str | None = None
        self.ready = asyncio.Event()

    def offer(self, data: str) -> None:               # engine thread
        def put():
            self.latest = data
            self.ready.set()
        try:
            self.loop.call_soon_threadsafe(put)
        except RuntimeError:
            pass

    async def next(self) -> str:
        await self.ready.wait()
        self.ready.clear()
        return self.latest


def add_dashboard(app: FastAPI, llm) -> None:
    hub = _Hub(llm)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(PAGE.read_text())

    @app.get("/dashboard/events")
    async def dashboard_events():
        if llm.engine is None:
            raise HTTPException(501, "the dashboard reads the engine between steps on its thread: it needs the "
                                     "engine core in the server's process (start the server without "
                                     "--engine-core-process)")
        page = _Page()
        hub.join(page)

        async def feed():
            try:
                while True:
                    yield f"data: {await page.next()}\n\n"
            finally:
                hub.leave(page)

        return StreamingResponse(feed(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
