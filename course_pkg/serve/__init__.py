"""The engine as a service (chapter 13): an OpenAI-compatible server over ``AsyncLLM``.

``python -m course_pkg.serve [--model DIR] [--port N]`` (or ``make serve``) serves the tiny model
on 127.0.0.1:8000. From Python -- a test, a notebook -- ``ServerThread`` runs the same app in a
thread on a free port::

    llm = AsyncLLM(num_kvcache_blocks=128)
    with ServerThread(build_app(llm)) as server:     # server.url == "http://127.0.0.1:<port>"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        ...
    llm.shutdown()
"""
from __future__ import annotations

import socket
import threading
import time

from course_pkg.serve.api_server import build_app

__all__ = ["build_app", "ServerThread"]


class ServerThread:
    """A uvicorn server for ``app`` in a background thread, on ``host:port`` (0: a free port).

    The socket is bound before the thread starts, so the port is known and cannot be taken by
    someone else meanwhile. ``start()`` returns once the server accepts connections; ``stop()``
    asks it to exit and waits (open streams get ``graceful_s`` seconds to end).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, graceful_s: float = 2.0):
        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_s,
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.socket.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
