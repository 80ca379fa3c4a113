"""`specpipe generate` as a user runs it: JSON output, streaming, seeds, and clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from specpipe.entrypoints.cli import main
from specpipe.loader.default_model import DefaultModelMissing, default_model_path

STAT_KEYS = {"pipeline_steps", "tokens_per_step", "hit_rate", "ttft_ms", "tbt_ms"}


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_json_output_has_the_documented_shape(capsys, tiny_llama_dir):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--max-tokens", "8",
                             "--no-chat", "--json", "the cat")
    assert code == 0, err
    d = last_json(out)
    assert set(d) == {"text", "prompt_token_ids", "token_ids", "finish_reason", "stats"}
    assert STAT_KEYS <= set(d["stats"])
    assert len(d["token_ids"]) == 8 and d["finish_reason"] == "length"
    assert d["stats"]["pipeline_steps"] == 8 and d["stats"]["tokens_per_step"] == 1.0
    assert d["stats"]["hit_rate"] is None  # no speculation in mode pp
    assert d["prompt_token_ids"][:2] == [116, 257]  # "t" (its byte value), then the merged "he"


def test_streamed_text_equals_json_text(capsys, tiny_llama_dir):
    args = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "12", "--no-chat", "hello"]
    code, streamed, _ = run_cli(capsys, *args)
    assert code == 0
    code, out, _ = run_cli(capsys, *args, "--json")
    assert streamed.rstrip("\n") == last_json(out)["text"]


def test_seed_reproduces_a_sample(capsys, tiny_llama_dir):
    base = ["generate", "--model", str(tiny_llama_dir), "--max-tokens", "16", "--no-chat", "--json",
            "--temperature", "1.0", "--top-k", "50"]
    a = last_json(run_cli(capsys, *base, "--seed", "11", "x")[1])["token_ids"]
    b = last_json(run_cli(capsys, *base, "--seed", "11", "x")[1])["token_ids"]
    c = last_json(run_cli(capsys, *base, "--seed", "12", "x")[1])["token_ids"]
    assert a == b and a != c


def test_chat_template_is_used_by_default(capsys, tiny_llama_dir):
    d = last_json(run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--max-tokens", "2", "--json", "hi")[1])
    assert d["prompt_token_ids"][0] == 267  # <|im_start|>


def assert_user_error(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert err.startswith("specpipe: error:"), err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("argv,words", [
    (["--stages", "0"], ["--stages"]),
    (["--stages", "9"], ["layers"]),
    (["--stages", "2", "--stage-layers", "1,2"], ["sums to 3", "4 layers"]),
    (["--mode", "fast"], ["unknown mode"]),
    (["--draft", "ngram"], ["mode pp"]),
    (["--mode", "specpipe", "--draft", "self:9"], ["self:K"]),
    (["--max-context", "8"], ["exceeds the context"]),
    (["--temperature", "-1"], ["temperature"]),
    (["--mode", "specpipe", "--layers-per-step", "17"], ["--layers-per-step"]),
    (["--cluster", "ray", "--ray-address", "127.0.0.1:9"], ["no Ray cluster", "ray start --head"]),
    (["--cluster", "ray", "--transport", "inproc"], ["--transport inproc"]),
])
def test_bad_options_are_clear_errors(capsys, tiny_llama_dir, argv, words):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--no-chat", *argv,
                           "a prompt that is long enough")
    assert_user_error(code, err, *words)


@pytest.mark.parametrize("layers", ["3", "auto"])
def test_layers_per_step_gives_the_pp_tokens(capsys, tiny_llama_dir, layers):
    common = ["generate", "--model", str(tiny_llama_dir), "--no-chat", "--json", "--max-tokens", "12", "the cat sat"]
    code, out, err = run_cli(capsys, *common)
    assert code == 0, err
    code, out3, err = run_cli(capsys, *common, "--mode", "specpipe", "--stages", "2", "--transport", "inproc",
                              "--layers-per-step", layers)
    assert code == 0, err
    assert last_json(out3)["token_ids"] == last_json(out)["token_ids"]


def test_missing_corrupt_and_refused_models(capsys, tmp_path, tiny_llama_dir):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope.gguf"), "x")
    assert_user_error(code, err, "not found")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model" * 10)
    assert_user_error(*run_cli(capsys, "generate", "--model", str(junk), "x")[::2], "GGUF")
    pickled = tmp_path / "model.bin"
    pickled.write_bytes(b"\x80\x04")
    assert_user_error(*run_cli(capsys, "generate", "--model", str(pickled), "x")[::2], "pickled")
    odd = tmp_path / "odd"
    shutil.copytree(tiny_llama_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (odd / "config.json").write_text(json.dumps(cfg))
    assert_user_error(*run_cli(capsys, "generate", "--model", str(odd), "x")[::2], "gpt2")


def test_truncated_default_model_is_a_clear_error(capsys, tmp_path):
    try:
        src = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(src.stat().st_size // 2))
    assert_user_error(*run_cli(capsys, "generate", "--model", str(cut), "x")[::2], "truncated")


def test_draft_with_another_tokenizer_is_refused(capsys, tmp_path, tiny_llama_dir):
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    tj["model"]["vocab"] = {k + ("x" if v == 100 else ""): v for k, v in tj["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(tj))
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--mode", "specpipe",
                           "--draft", str(other), "--no-chat", "x")
    assert_user_error(code, err, "tokenizer differs")


def test_default_model_end_to_end():
    """The README's third command, as a subprocess: the embedded model answers."""
    try:
        default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    p = subprocess.run([sys.executable, "-m", "specpipe.entrypoints.cli", "generate", "--max-tokens", "12",
                        "--json", "--mode", "specpipe", "Name the capital of France."],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    d = last_json(p.stdout)
    assert "Paris" in d["text"]


@pytest.mark.parametrize("argv,words", [
    (["--max-queue", "0"], ["--max-queue", "at least 1"]),
    (["--max-queue", "-3"], ["--max-queue"]),
    (["--max-queue-per-client", "0"], ["--max-queue-per-client", "[1, --max-queue=1024]"]),
    (["--max-queue", "4", "--max-queue-per-client", "5"], ["--max-queue-per-client", "[1, --max-queue=4]"]),
    (["--max-concurrency", "0"], ["--max-concurrency", "at least 1"]),
    (["--max-body-bytes", "10"], ["--max-body-bytes", "1024"]),
    (["--max-body-bytes", "lots"], ["--max-body-bytes"]),
    (["--metrics-need-key"], ["--metrics-need-key", "--api-key"]),
])
def test_serve_refuses_limits_that_cannot_serve_in_one_line(capsys, tiny_llama_dir, argv, words):
    """--max-queue 0 was accepted: every request got 429 (and EngineCore.run spun forever). Each
    is refused in one line before the model loads or the port is taken."""
    code, _, err = run_cli(capsys, "serve", "--model", str(tiny_llama_dir), "--port", "0", *argv)
    assert_user_error(code, err, *words)
    assert err.strip().count("\n") == 0, err


def test_ignore_eos_decodes_up_to_max_tokens(capsys, tiny_model_dir):
    """The tiny model ends this text after some 170 tokens; --ignore-eos goes on to --max-tokens."""
    model = str(tiny_model_dir("llama", max_position_embeddings=4096))
    base = ["generate", "--model", model, "--max-tokens", "400", "--no-chat", "--json", "the theatre in the sea"]
    stopped = last_json(run_cli(capsys, *base)[1])
    assert stopped["finish_reason"] == "stop" and len(stopped["token_ids"]) < 400
    d = last_json(run_cli(capsys, *base, "--ignore-eos")[1])
    assert d["finish_reason"] == "length" and len(d["token_ids"]) == 400
    assert d["token_ids"][:len(stopped["token_ids"])] == stopped["token_ids"]
