#!/usr/bin/env python3
"""A log-likelihood task through lm-evaluation-harness against `specpipe serve` and llama.cpp's
server (llama-cpp-python) on the same GGUF, and the same sums from transformers in float32 on the
GGUF's weights dequantized (issue 62's accuracy goal). Real run; never in CI.

The task is test_lm_eval.py's `specpipe_ll` (tests/entrypoints/lm_eval_tasks/specpipe_ll.yaml,
multiple_choice, metric acc) over a JSONL written to a temporary folder: that test's three items
(ll.jsonl) and --items more built from the repo's own docs (docs/*.md, sorted; nothing is
downloaded): each sentence of at least 11 words in a prose paragraph (no tables, lists, code)
gives an item whose context is its first 8 words and whose choices are its next 3 words and the
3 words after the 8th of two other sentences, in an order drawn by a seeded generator. The items are written into the result file, and
--items-from FILE runs a result file's items again (the docs change; the same items do not).

Backends (--backends, any of):
  specpipe          `python -m specpipe.entrypoints.cli serve --model GGUF` (its default mode
                    and kernels), lm_eval's `local-completions` with token-id prompts and its
                    default tokenizer backend (the server's /tokenize)
  specpipe-float32  the same server with SPECPIPE_KERNEL=float32 (every weight dequantized)
  llamacpp-server   `python -m llama_cpp.server --model GGUF --logits_all true`, lm_eval's
                    `local-completions` with text prompts (its server takes no token ids),
                    tokenized on lm_eval's side by the GGUF's tokenizer as transformers reads it
  llamacpp          llama-cpp-python's `Llama(logits_all=True)` in this process: `eval` of each
                    request's ids, log_softmax of the scores (what the server's numbers should be)
  transformers      AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) (transformers
                    dequantizes the GGUF), float32, one forward per request
The direct backends (llamacpp, transformers) score the ids lm_eval's own split gives: the whole
text's ids (context + choice), the context's ids a prefix of them, no BOS (lm_eval's default for
API models); accuracy is lm_eval's acc, the choice of highest log-likelihood.

Reported: each backend's accuracy (items right of all), and for each pair of backends the
per-choice log-likelihood differences (median and worst |difference|, in nats, and per token
of the choice), and how many items the two answer differently. For llama.cpp's server, also which of llama.cpp's
own values its echoed prompt log-probabilities are (the token's at its position, or at the next
one: llama-cpp-python issue 1983), probed with the first request's text, and how many choices it
scored 0.0 (lm_eval sums token_logprobs[ctxlen:-1], the last being the generated token's; a
server that returns none for it loses the choice's last token instead).

    PYTHONPATH=. python benchmarks/lm_eval_accuracy.py [--model GGUF] [--items 40] \\
        [--backends specpipe llamacpp-server llamacpp transformers] [--threads 2] [--out FILE.json]

--model: a GGUF (default: the embedded SmolLM2-135M Q4_1). The llama.cpp backends need
llama-cpp-python (built from source, minutes) and, for its server, its extras (fastapi, uvicorn,
sse-starlette, starlette-context, pydantic-settings); none of them is a dependency of specpipe.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "entrypoints" / "lm_eval_tasks"
TASK = "specpipe_ll"
NAME = "m"
BACKENDS = ("specpipe", "specpipe-float32", "llamacpp-server", "llamacpp", "transformers")


# -- the task --------------------------------------------------------------------------------------------
def repo_items(n: int, seed: int = 0) -> list[dict]:
    """test_lm_eval's three items, then n built from docs/*.md (see the module)."""
    items = [json.loads(line) for line in (TASKS / "ll.jsonl").read_text().splitlines() if line.strip()]
    lines = []
    for path in sorted((REPO / "docs").glob("*.md")):
        # paragraphs of prose (not headings, tables, lists, code), then their sentences
        for para in re.split(r"\n\s*\n", path.read_text()):
            if not re.match(r"^[A-Z][a-z]", para) or "|" in para or "`" in para or "```" in para:
                continue
            for sentence in re.split(r"(?<=[.;:])\s+", " ".join(para.split())):
                words = sentence.split()
                if len(words) >= 11 and re.match(r"^[A-Z][a-z]", sentence):
                    lines.append(words)
    rng = random.Random(seed)
    rng.shuffle(lines)
    lines = lines[:n]
    for i, words in enumerate(lines):
        truth = " " + " ".join(words[8:11])
        others = [" " + " ".join(lines[(i + k) % len(lines)][8:11]) for k in (1, 2)]
        choices = [truth] + [o for o in others if o != truth]
        order = list(range(len(choices)))
        rng.shuffle(order)
        items.append({"context": " ".join(words[:8]), "choices": [choices[j] for j in order], "label": order.index(0)})
    return items


def task_folder(items: list[dict]) -> Path:
    d = Path(tempfile.mkdtemp(prefix="lm_eval_accuracy_"))
    shutil.copy(TASKS / "specpipe_ll.yaml", d / "specpipe_ll.yaml")
    (d / "ll.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    return d


def evaluate(folder: Path, args: dict) -> list[list[float]]:
    """lm_eval's local-completions over the task; per item (doc order) each choice's log-likelihood."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    here = os.getcwd()
    os.chdir(folder)  # the YAML's data_files are relative to it
    try:
        out = simple_evaluate(model="local-completions", model_args=args, tasks=[TASK],
                              task_manager=TaskManager(include_path=str(folder)), log_samples=True)
    finally:
        os.chdir(here)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [[r[0][0] for r in s["resps"]] for s in samples]


# -- servers ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cmd: list[str], port: int, ready: str, env: dict | None = None, timeout: float = 900) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="lm_eval_accuracy_server_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited {self.proc.returncode}: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + ready, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{cmd[:4]} not ready in {timeout} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_specpipe(model: str, folder: Path, threads: int, kernel: str | None, texts: list[str]) -> dict:
    port = free_port()
    env = {"SPECPIPE_KERNEL": kernel} if kernel else {}
    srv = Server([sys.executable, "-m", "specpipe.entrypoints.cli", "serve", "--model", model, "--port", str(port),
                  "--served-model-name", NAME, "--max-context", "1024", "--log-level", "warning",
                  "--stage-threads", str(threads)], port, "/health", {"PYTHONPATH": str(REPO), **env})
    try:
        # the server's tokenizer against the one the direct backends use (transformers' GGUF reader)
        ids = [httpx.post(srv.url + "/tokenize", json={"prompt": t, "add_special_tokens": False}, timeout=60).json()["tokens"]
               for t in texts]
        t0 = time.time()
        lls = evaluate(folder, dict(base_url=f"{srv.url}/v1/completions", model=NAME, tokenized_requests=True,
                                    max_length=1024, num_concurrent=1, max_retries=1, batch_size=1))
        return {"lls": lls, "seconds": time.time() - t0, "ids": ids}
    finally:
        srv.stop()


def run_llamacpp_server(model: str, folder: Path, threads: int, tokenizer_dir: Path, probe: str) -> dict:
    port = free_port()
    srv = Server([sys.executable, "-m", "llama_cpp.server", "--model", model, "--logits_all", "true", "--port",
                  str(port), "--n_ctx", "1024", "--n_threads", str(threads), "--model_alias", NAME], port, "/v1/models")
    try:
        # what lm_eval's request gets for one text: its echoed token_logprobs (checked in main
        # against llama.cpp's own logits, both alignments)
        r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
            "model": NAME, "prompt": probe, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}).json()
        t0 = time.time()
        lls = evaluate(folder, dict(base_url=f"{srv.url}/v1/completions", model=NAME, tokenized_requests=False,
                                    tokenizer=str(tokenizer_dir), tokenizer_backend="huggingface", max_length=1024,
                                    num_concurrent=1, max_retries=1, batch_size=1))
        return {"lls": lls, "seconds": time.time() - t0, "probe": r["choices"][0]["logprobs"]["token_logprobs"]}
    finally:
        srv.stop()


# -- direct ----------------------------------------------------------------------------------------------
def requests_of(items: list[dict], tok) -> list[list[tuple[list[int], int]]]:
    """Per item, per choice: (the whole text's ids, the context's length), as lm_eval splits them."""
    out = []
    for it in items:
        ctx = tok.encode(it["context"], add_special_tokens=False)
        row = []
        for c in it["choices"]:
            whole = tok.encode(it["context"] + c, add_special_tokens=False)
            assert whole[:len(ctx)] == ctx, (it["context"], c)
            row.append((whole, len(ctx)))
        out.append(row)
    return out


def summed(lp, whole: list[int], ctxlen: int) -> float:
    return float(sum(float(lp[i - 1, whole[i]]) for i in range(ctxlen, len(whole))))


def run_transformers(model: str, reqs) -> dict:
    import torch
    import transformers

    d, f = os.path.split(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    t0 = time.time()
    lls = []
    with torch.inference_mode():
        for row in reqs:
            lls.append([summed(torch.log_softmax(hf(torch.tensor([w])).logits[0].float(), -1), w, c) for w, c in row])
    return {"lls": lls, "seconds": time.time() - t0}


def run_llamacpp(model: str, reqs, threads: int, probe: list[int]) -> dict:
    import numpy as np
    import torch
    from llama_cpp import Llama

    llm = Llama(model_path=model, logits_all=True, n_ctx=1024, n_threads=threads, verbose=False)
    t0 = time.time()
    lls = []
    for row in reqs:
        got = []
        for w, c in row:
            llm.reset()
            llm.eval(w)
            scores = torch.from_numpy(np.array(llm.scores[:len(w)], dtype=np.float32))
            got.append(summed(torch.log_softmax(scores, -1), w, c))
        lls.append(got)
    seconds = time.time() - t0
    llm.reset()
    llm.eval(probe)
    lp = torch.log_softmax(torch.from_numpy(np.array(llm.scores[:len(probe)], dtype=np.float32)), -1)
    return {"lls": lls, "seconds": seconds,
            "probe_right": [None] + [float(lp[i - 1, probe[i]]) for i in range(1, len(probe))],  # log p(t_i | t_<i)
            "probe_shifted": [None] + [float(lp[i, probe[i]]) for i in range(1, len(probe))]}  # log p_(i+1)(t_i)


def server_alignment(server: dict, direct: dict, probe: list[int]) -> dict:
    """Which of llama.cpp's own values the server's echoed token_logprobs are: the token's
    log-probability at its position, or at the next (llama-cpp-python issue 1983)."""
    got = server["probe"]
    n = min(len(got), len(probe))
    worst = lambda ref: max(abs(got[i] - ref[i]) for i in range(1, n))  # noqa: E731
    return {"prompt_tokens": len(probe), "token_logprobs_returned": len(got),
            "worst_vs_right": worst(direct["probe_right"]), "worst_vs_shifted": worst(direct["probe_shifted"])}


# -- report ----------------------------------------------------------------------------------------------
def accuracy(lls: list[list[float]], items: list[dict]) -> int:
    return sum(max(range(len(r)), key=r.__getitem__) == it["label"] for r, it in zip(lls, items))


def compare(a: list[list[float]], b: list[list[float]], reqs) -> dict:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    per_token = [abs(x - y) / (len(w) - c) for ra, rb, row in zip(a, b, reqs) for x, y, (w, c) in zip(ra, rb, row)]
    picks = sum(max(range(len(ra)), key=ra.__getitem__) != max(range(len(rb)), key=rb.__getitem__) for ra, rb in zip(a, b))
    return {"choices": len(diffs), "median_abs_nats": statistics.median(diffs), "worst_abs_nats": max(diffs),
            "median_abs_nats_per_token": statistics.median(per_token), "worst_abs_nats_per_token": max(per_token),
            "items_answered_differently": picks}


def summarize(model, items, reqs, results, threads, load_before) -> dict:
    from benchmarks.common import cpu_name

    names = list(results)
    comparisons = {f"{a} vs {b}": compare(results[a]["lls"], results[b]["lls"], reqs)
                   for i, a in enumerate(names) for b in names[i + 1:]}
    alignment = None
    if "llamacpp-server" in results and "llamacpp" in results:
        alignment = server_alignment(results["llamacpp-server"], results["llamacpp"], reqs[0][0][0])
    return {"model": model, "items": len(items), "choices": sum(len(it["choices"]) for it in items),
            "cpu": cpu_name(), "cpus": os.cpu_count(), "threads": threads,
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "accuracy": {b: r["accuracy"] for b, r in results.items()},
            "seconds": {b: round(r["seconds"], 1) for b, r in results.items()},
            "comparisons": comparisons, "llamacpp_server_echo_alignment": alignment, "results": results,
            "task_items": items, "command": " ".join(sys.argv)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--items", type=int, default=40, help="items built from docs/*.md, besides the test's three")
    ap.add_argument("--backends", nargs="+", default=["specpipe", "llamacpp-server", "llamacpp", "transformers"],
                    choices=BACKENDS)
    ap.add_argument("--items-from", help="a result file of this script: run its task_items again (docs/*.md change)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.common import resolve_model, write_json

    model = resolve_model(args.model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="hf_datasets_"))
    import transformers

    d, f = os.path.split(model)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok_dir = Path(tempfile.mkdtemp(prefix="gguf_tokenizer_"))
    tok.save_pretrained(tok_dir)  # lm_eval's huggingface tokenizer backend for llama.cpp's server
    items = json.load(open(args.items_from))["task_items"] if args.items_from else repo_items(args.items)
    folder = task_folder(items)
    reqs = requests_of(items, tok)
    texts = [it["context"] + c for it in items for c in it["choices"]]
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    for b in args.backends:
        print(f"== {b}", flush=True)
        if b.startswith("specpipe"):
            r = run_specpipe(model, folder, args.threads, "float32" if b == "specpipe-float32" else None, texts)
            want = [w for row in reqs for w, _ in row]
            r["tokenize_mismatches"] = sum(x != y for x, y in zip(r.pop("ids"), want))
        elif b == "llamacpp-server":
            r = run_llamacpp_server(model, folder, args.threads, tok_dir, texts[0])
        elif b == "llamacpp":
            r = run_llamacpp(model, reqs, args.threads, reqs[0][0][0])
        else:
            r = run_transformers(model, reqs)
        r["accuracy"] = accuracy(r["lls"], items)
        r["choices_scored_0"] = sum(x == 0.0 for row in r["lls"] for x in row)
        results[b] = r
        print(json.dumps({b: {k: v for k, v in r.items() if k != "lls"}}), flush=True)
        summary = summarize(model, items, reqs, results, args.threads, load_before)
        if args.out:  # after each backend, so that a run cut short keeps what it measured
            write_json(args.out, summary)
    print(json.dumps({k: summary[k] for k in ("model", "items", "accuracy", "seconds", "comparisons",
                                              "llamacpp_server_echo_alignment",
                                              "load_average_before", "load_average_after")}, indent=1))


if __name__ == "__main__":
    main()
