"""Text <-> token ids, for Hugging Face model directories and GGUF files alike.

The Rust `tokenizers` library does the work. A HF directory's tokenizer.json is used as is. A GGUF
file carries no tokenizer.json, only llama.cpp's metadata (vocabulary, merges, token types and the
*name* of a pre-tokenizer), so the equivalent pipeline is rebuilt here, following llama.cpp's
llama-vocab.cpp: that is the implementation every GGUF file was converted for.
"""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from specpipe.loader.gguf_metadata import GGUFMetadataError, read_gguf_metadata

log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used; the message is meant for the user."""


# --- byte-level BPE from GGUF ("gpt2") ----------------------------------------------------------

# Pre-tokenizer regexes, as in the models' own tokenizer.json (llama.cpp carries equivalent ones).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# family: (regexes applied one after the other, ignore_merges, add BOS when the file does not say)
_FAMILIES: dict[str, tuple[list[str], bool, bool]] = {
    # llama.cpp's fallback: punctuation runs, then GPT-2, then numbers and groups of 3 digits
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False, False),
    "gpt2": ([_GPT2], False, False),
    # StarCoder-style vocabularies (SmolLM, SmolLM2): every digit alone, then GPT-2
    "starcoder": ([r"\p{N}", _GPT2], False, False),
    # Llama 3 looks a whole pre-token up before merging (HF "ignore_merges": true)
    "llama3": ([_LLAMA3], True, True),
    "qwen2": ([_QWEN2], False, False),
}
# tokenizer.ggml.pre -> family, the names llama.cpp gives them
_PRE_NAMES = {
    "default": "default",
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r"), "starcoder"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), "qwen2"),
}

_CONTROL, _USER_DEFINED, _UNKNOWN, _NORMAL = 3, 4, 2, 1
_ADDED = (_CONTROL, _USER_DEFINED, _UNKNOWN)  # token types matched whole in the text
# End-of-generation tokens besides eos/eot that llama.cpp also stops on, when marked as control.
_EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<EOT>"}


def _byte_level_from_gguf(meta: dict[str, Any], path: Path) -> tuple[_Backend, bool]:
    pre = meta.get("tokenizer.ggml.pre")
    if not pre:
        log.warning("%s: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer", path)
        pre = "default"
    if pre not in _PRE_NAMES:
        raise TokenizerError(
            f"{path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_NAMES))}"
        )
    family = _PRE_NAMES[pre]
    regexes, ignore_merges, add_bos_default = _FAMILIES[family]
    tokens = meta["tokenizer.ggml.tokens"]
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError(f"{path}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    # Byte-level tokens spell a space as "Ġ", so the one real space in a merge separates the pair.
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = _Backend(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    if family == "qwen2":  # Qwen2's tokenizer.json normalizes to NFC before splitting
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend, add_bos_default


# --- SentencePiece from GGUF ("llama": Llama 2, Mistral v0.1) ----------------------------------


def _sentencepiece_from_gguf(meta: dict[str, Any], path: Path) -> tuple[_Backend, bool]:
    """SentencePiece BPE rebuilt as tokenizers' BPE, the way HF converts Llama 2's tokenizer.

    SentencePiece merges the pair whose result scores highest; ranking merges by that score gives
    tokenizers' BPE the same order. Characters outside the vocabulary fall back to <0xNN> tokens.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    normal = {t for t, ty in zip(tokens, types) if ty == _NORMAL}
    ranked = []
    for i, merged in enumerate(tokens):
        if types[i] != _NORMAL:  # control, byte and user-defined pieces never come out of merging
            continue
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, vocab[left], (left, right)))
    ranked.sort()
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = _Backend(
        models.BPE(vocab, [r[3] for r in ranked], unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    # llama.cpp puts the dummy-prefix space before the text and after every special token; a
    # normalizer does exactly that, because it runs on each piece between added tokens.
    replace = normalizers.Replace(" ", "\u2581")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = replace
    backend.decoder = decoders.Sequence(steps)
    return backend, True


def _from_gguf(path: Path) -> Tokenizer:
    try:
        meta = read_gguf_metadata(path)
    except GGUFMetadataError as e:
        raise TokenizerError(str(e)) from None
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError(f"{path}: this GGUF file holds no tokenizer (no tokenizer.ggml.tokens)")
    builders = {"gpt2": _byte_level_from_gguf, "llama": _sentencepiece_from_gguf}
    if kind not in builders:
        raise TokenizerError(
            f"{path}: tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE "
            "and 'llama' SentencePiece)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    if any(len(meta.get(f"tokenizer.ggml.{k}") or tokens) != len(tokens) for k in ("token_type", "scores")):
        raise TokenizerError(f"{path}: tokenizer metadata is inconsistent (types/scores vs tokens)")
    try:
        backend, add_bos_default = builders[kind](meta, path)
    except TokenizerError:
        raise
    except Exception as e:  # the Rust side raises a bare Exception, e.g. for a merge of unknown tokens
        raise TokenizerError(f"{path}: tokenizer metadata is inconsistent ({e})") from e
    # Matched whole in the text, so "<|im_start|>" is one id; control ones are dropped when
    # decoding with skip_special_tokens, user-defined ones (like "<think>") are kept, as in HF.
    typed = list(zip(tokens, types))
    added = [AddedToken(t, special=ty != _USER_DEFINED, normalized=False) for t, ty in typed if ty in _ADDED]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])

    def token_id(key: str) -> int | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return i if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    _set_post_processor(backend, tokens, bos if add_bos else None, eos if add_eos else None)
    eog = [eos, token_id("eot_token_id"), token_id("eom_token_id")]
    eog += [i for i, (t, ty) in enumerate(typed) if ty == _CONTROL and t in _EOG_TEXTS]
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=eog, chat_template=template, source=str(path))


def _set_post_processor(backend: _Backend, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """BOS/EOS around every encoded text, for the models whose metadata asks for them."""
    if bos is None and eos is None:
        return
    single = ([tokens[bos]] if bos is not None else []) + ["$A"] + ([tokens[eos]] if eos is not None else [])
    ends = [(tokens[i], i) for i in dict.fromkeys(i for i in (bos, eos) if i is not None)]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=ends)


# --- Hugging Face directories ------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _from_hf_dir(d: Path) -> Tokenizer:
    tokenizer_json = d / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise TokenizerError(
            f"{d}: no tokenizer.json in this directory; only 'fast' tokenizers are supported "
            "(transformers' AutoTokenizer(...).save_pretrained() writes one)"
        )
    try:
        backend = _Backend.from_file(str(tokenizer_json))
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise TokenizerError(f"{tokenizer_json}: cannot be loaded ({e})") from e
    # Some tokenizer.json files ship with truncation/padding on, which would silently cut prompts.
    backend.no_truncation()
    backend.no_padding()
    config = _read_json(d / "tokenizer_config.json")
    template = config.get("chat_template")
    if (d / "chat_template.jinja").is_file():  # newer transformers save it apart, and prefer it
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # several named templates: the one named "default", else the first
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)

    def content(key: str) -> str | None:
        token = config.get(key)
        text = token.get("content") if isinstance(token, dict) else token
        if text is not None and not isinstance(text, str):
            raise TokenizerError(f"{d / 'tokenizer_config.json'}: {key} must be a string or "
                                 f"{{\"content\": string}}, got {token!r:.80}")
        return text

    bos_text, eos_text = content("bos_token"), content("eos_token")
    eos_ids: list[int | None] = [backend.token_to_id(eos_text) if eos_text else None]
    for extra in (_read_json(d / "generation_config.json"), _read_json(d / "config.json")):
        ids = extra.get("eos_token_id")
        eos_ids += ids if isinstance(ids, list) else [ids]
    bos = backend.token_to_id(bos_text) if bos_text else None
    return Tokenizer(backend, bos_token_id=bos, eos_token_ids=eos_ids, chat_template=template, source=str(d))


# --- chat templates ----------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates are written against HF's plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str):
    """Compile a chat template in the environment transformers renders it in."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template is not valid Jinja (line {e.lineno}: {e.message})") from e


# --- the tokenizer -----------------------------------------------------------------------------


class Tokenizer:
    """Encode, decode and chat-format for one model; build it with `Tokenizer.from_path`."""

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_ids: list[int | None],
                 chat_template: str | None, source: str):
        if chat_template is not None and not isinstance(chat_template, str):
            raise TokenizerError(f"{source}: the chat template must be a string, got {type(chat_template).__name__}")
        self._backend = backend
        self.source = source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        # Harmony (gpt-oss): <|return|> and <|call|> end an answer; <|end|> only ends a message
        # within it (llama.cpp drops it from a GGUF's end-of-generation tokens too).
        harmony = [backend.token_to_id(t) for t in ("<|return|>", "<|call|>")]
        if None not in harmony:
            end = backend.token_to_id("<|end|>")
            eos_token_ids = [i for i in eos_token_ids if i != end] + harmony
        # deduplicated, primary eos first; ids outside the vocabulary (a damaged config) never match
        self.eos_token_ids = tuple(dict.fromkeys(
            i for i in eos_token_ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size))
        self.bos_token = backend.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        self._chat_template = chat_template or None
        self._compiled_template = None
        self._fingerprint: str | None = None

    @staticmethod
    def from_path(path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory or a .gguf file."""
        p = Path(path).expanduser()
        if not p.exists():
            raise TokenizerError(f"tokenizer not found: {p}")
        return _from_hf_dir(p) if p.is_dir() else _from_gguf(p)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text such as "<|im_start|>" becomes its single id.

        add_special_tokens adds BOS/EOS only where the model asks for them.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"can only encode text, not {type(text).__name__}")
        if len(text) > 4096:
            # encode_batch releases the GIL while the Rust side works (encode does not), so a long
            # prompt tokenized in a server's worker thread does not stall its event loop.
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def added_token_ids(self) -> list[int]:
        """Ids of the tokens added to the base vocabulary (specials such as <|im_end|>, and
        user-defined ones), ascending."""
        return sorted(self._backend.get_added_tokens_decoder())

    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (dropped when decoding with skip_special_tokens)."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def frequent_ids(self, n: int) -> list[int]:
        """About the n most frequent tokens, for a draft's cut vocabulary (--draft-vocab): the
        ids below n (BPE and SentencePiece vocabularies number their tokens in the order they were
        learned, the most frequent first), plus every added token and EOS (end of turn, end of
        text, ...) so that a draft can still propose stopping. Ascending."""
        if n < 1:
            raise ValueError(f"a draft vocabulary needs at least one token, got {n}")
        extra = [i for i in (*self.added_token_ids(), *self.eos_token_ids) if i >= n]
        return sorted({*range(min(n, self.vocab_size)), *extra})

    @property
    def chat_template(self) -> str | None:
        """The Jinja source (None without one): /tokenizer_info serves it."""
        return self._chat_template

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def reasons(self) -> bool:
        """The chat template is a reasoning model's: it writes or strips `</think>` (Qwen3,
        DeepSeek-R1, GLM-4.5, MiniMax-M2), so answers may open with <think>…</think>."""
        return "</think>" in (self._chat_template or "")

    @property
    def renders_tools(self) -> bool:
        """The chat template renders OpenAI tool definitions passed as `tools` (Qwen2.5's does)."""
        return "tools" in (self._chat_template or "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` with the model's template, as transformers does (tokenize=False).

        Extra keyword arguments (e.g. tools) are passed to the template.
        """
        if self._chat_template is None:
            raise TokenizerError(
                f"{self.source}: the model has no chat template; send a plain prompt instead of chat messages"
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self._chat_template)
        import jinja2

        context = {"tools": None, "documents": None}
        context.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        context.update(kwargs, messages=messages, add_generation_prompt=add_generation_prompt)
        try:
            return self._compiled_template.render(**context)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the model's chat template failed: {e}") from e

    def fingerprint(self) -> str:
        """SHA-256 of the token strings in id order and the merges.

        Two tokenizers with the same fingerprint map text to the same ids, whichever file they
        came from; speculative decoding needs that of its draft and target models.
        """
        if self._fingerprint is None:
            spec = json.loads(self._backend.to_str())
            model = spec.get("model", {})
            vocab = model.get("vocab") or {}  # {token: id}, or [[token, score], ...] for Unigram
            pairs = vocab.items() if isinstance(vocab, dict) else ((t, i) for i, (t, _) in enumerate(vocab))
            by_id = {i: t for t, i in pairs}
            by_id.update({a["id"]: a["content"] for a in spec.get("added_tokens", [])})
            merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges") or []]
            tokens = [by_id.get(i) for i in range(max(by_id, default=-1) + 1)]
            blob = json.dumps({"tokens": tokens, "merges": merges}, ensure_ascii=False)
            self._fingerprint = hashlib.sha256(blob.encode("utf-8")).hexdigest()
        return self._fingerprint


# --- streaming ---------------------------------------------------------------------------------

_PROMPT_CONTEXT = 6  # prompt tokens kept as left context: enough to settle spacing and merging


class IncrementalDetokenizer:
    """Turns generated ids into text piece by piece, for streaming.

    Each call decodes a short window of recent ids twice (with and without the new one) and returns
    what the new one added. Text ending in U+FFFD is held back: it is a character whose UTF-8 bytes
    are spread over several tokens and not all have arrived. The pieces plus flush() equal
    decode(generated ids) for byte-level tokenizers; prompt_ids give left context so SentencePiece
    keeps the leading space a continuation of the prompt needs (decode() alone would strip it).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens=True,
                 keep: frozenset[int] = frozenset()):
        """`keep`: special tokens whose text is kept all the same (a family's tool-call markup,
        which the server must read: vLLM decodes those with skip_special_tokens off)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._drop = tokenizer.special_ids() - keep if skip_special_tokens and keep else None
        context = list(prompt_ids or [])[-_PROMPT_CONTEXT:]
        if self._decode(context).endswith("\ufffd"):  # the prompt ends mid-character: no usable context
            context = []
        self._ids = context
        self._prefix = 0  # window start: ids before it are done with
        self._read = len(context)  # ids before it have had their text returned

    def _decode(self, ids: list[int]) -> str:
        if self._drop is not None:
            return self._tokenizer.decode([i for i in ids if i not in self._drop], skip_special_tokens=False)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def add(self, token_id: int) -> str:
        """Append one generated id; returns the text it completes (often "", never a broken character)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back, at the end of generation."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        # The next window starts at the ids whose text was just returned; older ones are dropped.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(done) :]
