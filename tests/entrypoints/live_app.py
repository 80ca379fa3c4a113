"""An in-process server for the API tests: build_app on a real uvicorn in a background thread, on
a free loopback port, over a tiny model whose chat template is a reasoning model's (Qwen3's
shape: `enable_thinking: false` renders an empty <think></think> into the prompt)."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import uvicorn

from specpipe.config import EngineConfig
from specpipe.engine.async_engine import AsyncEngine
from specpipe.engine.engine import Engine
from specpipe.engine.metrics import EngineMetrics
from specpipe.entrypoints.openai.api_server import ServerOptions, build_app, uvicorn_config

NAME = "tiny"
KEY = "key-a"

THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def tiny_llama(tiny_model_dir) -> Path:
    """The tiny llama the API tests serve (tests/conftest.py's `tiny_model_dir`)."""
    return tiny_model_dir("llama", num_hidden_layers=2, max_position_embeddings=1024)


def thinking_model(tiny_model_dir, tmp_path: Path) -> Path:
    """A copy of the tiny llama whose template is THINKING_TEMPLATE."""
    src = tiny_llama(tiny_model_dir)
    dst = tmp_path / "thinking"
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return dst


def engine_of(model: Path) -> Engine:
    """specpipe-db with n-grams over two in-process stages of `model`: what the API tests serve."""
    return Engine(EngineConfig(model=str(model), mode="specpipe-db", draft="ngram", stages=2, transport="inproc",
                               kv_memory="8MiB", max_context=1024))


def plain_engine(model: Path) -> Engine:
    """Plain pp decoding in this process, one request at a time: what a server's answer must equal."""
    return Engine(EngineConfig(model=str(model), mode="pp", transport="inproc", kv_memory="8MiB", max_context=1024))


class LiveServer:
    def __init__(self, engine: Engine, options: ServerOptions = ServerOptions(api_keys=(KEY,)),
                 names: tuple[str, ...] = (NAME,)) -> None:
        self.key = options.api_keys[0] if options.api_keys else None
        self.metrics = EngineMetrics(lambda: self.aengine.snapshot, lambda: self.aengine.dead is None, names[0])
        self.aengine = AsyncEngine(engine.core(), observer=self.metrics, admit_timeout_s=30)
        self.app = build_app(engine, self.aengine, self.metrics, names, options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(self.app, options, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def client(self) -> openai.OpenAI:
        """The official client, with the server's first API key (if it has any)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "none", max_retries=0, timeout=120)

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        return httpx.post(self.url + path, headers=headers, timeout=120, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.aengine.shutdown()


@contextmanager
def serving(model: Path, options: ServerOptions = ServerOptions(api_keys=(KEY,)), names: tuple[str, ...] = (NAME,)):
    """A LiveServer over engine_of(model), stopped and its engine closed on the way out."""
    engine = engine_of(model)
    server = LiveServer(engine, options, names)
    try:
        yield server
    finally:
        server.stop()
        engine.close()


def float32_log_softmax(model: Path):
    """ids -> log_softmax of one transformers forward over them (T, V), the model's weights in
    float32: the reference the served log-probabilities are checked against."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()

    def run(ids):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run
