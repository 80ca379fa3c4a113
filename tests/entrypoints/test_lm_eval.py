"""lm-evaluation-harness's `local-completions` model against a live server, on two tasks built
from files in the repo (tests/entrypoints/lm_eval_tasks: a task YAML and a JSONL each, read with
datasets' local `json` builder; nothing is downloaded):

  * specpipe_ll (multiple_choice): lm_eval sends token-id prompts, three a request
    (batch_size 3), with `echo: true`, `max_tokens: 1` and `logprobs: 1`, and sums the prompt's `token_logprobs` over each
    continuation. Every per-choice log-likelihood it reports equals a direct log_softmax of the
    model's logits (transformers, the same weights in float32) within 1e-4.
  * specpipe_gen (generate_until): six stop strings (seven with the tokenizer's EOS text), greedy.
    Each output equals what the server gives for the same prompt sent directly; the same task
    through `local-chat-completions` (which sends the first four stop strings) equals the chat
    endpoint's answer.

The log-likelihood task runs with lm_eval's default tokenizer_backend ("auto"), which finds the
server's /tokenizer_info and tokenizes through /tokenize (no tokenizer files needed: a GGUF-only
model works); the generate_until task names the tiny model's own directory (tokenizer_backend
huggingface). Nothing reaches the hub; HF_HUB_OFFLINE and HF_DATASETS_OFFLINE make sure of it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import live_app  # tests/entrypoints is on sys.path for its tests
from specpipe.entrypoints.openai.api_server import ServerOptions

lm_eval = pytest.importorskip("lm_eval")

TASKS = Path(__file__).parent / "lm_eval_tasks"
NAME = "tiny"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return live_app.tiny_llama(tiny_model_dir)


@pytest.fixture(scope="module")
def server(model):
    with live_app.serving(model, ServerOptions(), names=(NAME,)) as s:
        yield s


@pytest.fixture(scope="module")
def evaluate(server, model, tmp_path_factory):
    """Runs one of the repo's tasks through local-completions; returns lm_eval's logged samples."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
    mp.chdir(TASKS)  # the YAMLs' data_files are relative to it
    manager = TaskManager(include_path=str(TASKS))

    def run(task: str, chat: bool = False, local_tokenizer: bool = False, batch_size: int = 1) -> list[dict]:
        if chat:  # messages in, text out: no tokenizer on lm_eval's side
            args = dict(base_url=f"{server.url}/v1/chat/completions", model=NAME, num_concurrent=1, max_retries=1)
        else:  # token-id prompts: lm_eval's default ("auto" finds the server's /tokenizer_info) or the model's files
            args = dict(base_url=f"{server.url}/v1/completions", model=NAME, tokenized_requests=True, max_length=1024,
                        num_concurrent=1, max_retries=1, batch_size=batch_size,
                        **(dict(tokenizer=str(model), tokenizer_backend="huggingface") if local_tokenizer else {}))
        out = simple_evaluate(model="local-chat-completions" if chat else "local-completions", model_args=args,
                              tasks=[task], task_manager=manager, log_samples=True, apply_chat_template=chat)
        return out["samples"][task]

    yield run
    mp.undo()


@pytest.fixture(scope="module")
def forward(model):
    return live_app.float32_log_softmax(model)


def test_tokenizer_info_names_the_special_tokens(server):
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"].startswith("{%")
    assert info["model_max_length"] == 1024


def test_loglikelihood_task_equals_a_direct_log_softmax(evaluate, forward, model, caplog):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    with caplog.at_level("INFO"):
        samples = evaluate("specpipe_ll", batch_size=3)  # its 8 requests as 3 lists of prompts
    assert "Using remote tokenizer backend" in caplog.text  # the server's /tokenize, no local files
    assert len(samples) == 3
    for s in samples:
        doc = s["doc"]
        got = [ll for ll, _ in (r[0] for r in s["resps"])]  # one (loglikelihood, is_greedy) per choice
        assert len(got) == len(doc["choices"])
        for choice, ll in zip(doc["choices"], got):
            # lm_eval's own split: the whole text's ids, the context's ids a prefix of them.
            ctx = tok.encode(doc["context"], add_special_tokens=False)
            whole = tok.encode(doc["context"] + choice, add_special_tokens=False)
            assert whole[:len(ctx)] == ctx
            lp = forward(whole)
            want = sum(float(lp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
            assert ll == pytest.approx(want, abs=1e-4), (doc["context"], choice)


def test_generate_until_task_equals_the_server_directly(evaluate, server):
    samples = evaluate("specpipe_gen", local_tokenizer=True)
    assert len(samples) == 2
    for s in samples:
        until = ["\n\n", "<|im_end|>", "zzz", "qqq", "###", "END"]
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": NAME, "prompt": s["doc"]["prompt"], "max_tokens": 12, "temperature": 0, "stop": until})
        assert r.status_code == 200, r.text
        direct = r.json()["choices"][0]["text"]
        assert s["resps"][0][0] == direct


def test_generate_until_through_local_chat_completions(evaluate, server):
    samples = evaluate("specpipe_gen", chat=True)
    assert len(samples) == 2
    for s in samples:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": NAME, "messages": [{"role": "user", "content": s["doc"]["prompt"]}], "max_tokens": 12,
            "temperature": 0, "seed": 1234, "stop": ["\n\n", "<|im_end|>", "zzz", "qqq"]})
        assert r.status_code == 200, r.text
        assert s["resps"][0][0] == r.json()["choices"][0]["message"]["content"]
