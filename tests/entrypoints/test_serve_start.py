"""`specpipe serve` says it serves only once its socket listens (issue 58, finding 10: the line
came before, and a client that connected on reading it was refused)."""

from __future__ import annotations

import socket
import threading
import time

from fastapi import FastAPI

from specpipe.entrypoints.openai.api_server import ServerOptions, _Server, uvicorn_config


def test_the_serving_line_comes_once_the_socket_accepts():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, as serve() does before loading the model, not yet listening
    port = sock.getsockname()[1]
    answers = []

    def on_listening():
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            answers.append("accepted")

    server = _Server(uvicorn_config(FastAPI(), ServerOptions(), "warning"), on_listening)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    server.should_exit = True
    thread.join(30)
    assert answers == ["accepted"]
