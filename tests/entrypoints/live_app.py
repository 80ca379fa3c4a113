"""An in-process server for the API tests: build_app on a real uvicorn in a background thread, on
a free loopback port, over a tiny model whose chat template is a reasoning model's (Qwen3's
shape: `enable_thinking: false` renders an empty <think></think> into the prompt)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

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


def thinking_model(tiny_model_dir, tmp_path: Path) -> Path:
    """A copy of the tiny llama whose template is THINKING_TEMPLATE."""
    src = tiny_model_dir("llama", num_hidden_layers=2, max_position_embeddings=1024)
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


class LiveServer:
    def __init__(self, engine: Engine, options: ServerOptions = ServerOptions(api_keys=(KEY,)),
                 names: tuple[str, ...] = (NAME,)) -> None:
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

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.aengine.shutdown()


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
