"""Fixtures the API tests share (live_app.py holds the server itself)."""

from __future__ import annotations

import pytest

from live_app import LiveServer, engine_of, thinking_model


@pytest.fixture(scope="session")
def thinking_server(tiny_model_dir, tmp_path_factory):
    """One in-process server over the tiny model with a reasoning model's template, for the
    reasoning, Anthropic and Responses tests (each compares its dialect with chat on it)."""
    engine = engine_of(thinking_model(tiny_model_dir, tmp_path_factory.mktemp("thinking")))
    server = LiveServer(engine)
    yield server
    server.stop()
    engine.close()
