"""Checkpoint fuzzing: damaged and hostile GGUF files and safetensors directories.

Each mutation starts from a tiny valid checkpoint written here (2 layers, hidden 32) and changes
it one way: a cut (truncation), a flipped bit, or one header field set to a hostile value (a
tensor or key count of 2^40, a string or array length of 2^60, a tensor offset past the end or
"negative" (a u64 near 2^64), an unknown value or tensor type, a dimension of 2^40, a config
claiming 2^40 layers, tokenizer metadata and files of the wrong type or shape). `try_load` then
does what serving does with a checkpoint (open it, build the whole model as one stage, run a
prefill and a decode row through it, so the kernels the stage chose compute on what the file
claims; load its tokenizer, encode, decode and render a chat message) and sorts the result into
one outcome:

  loaded      it loaded and ran (a flipped bit inside tensor data, a harmless metadata value)
  refused     one clear error: CheckpointError (the loader's type, ConfigError wrapped in it) or
              TokenizerError
  crash       any other exception: a bug
  allocation  it asked for far more memory than the file holds (tracemalloc's peak over
              `ALLOC_FACTOR` x the file size + `ALLOC_SLACK`): a header's claim was believed

A hang cannot be seen from inside; benchmarks/fuzz_checkpoints.py runs trials in a child
process with a deadline and a memory limit, and the tests rely on the suite's own time.
A test tool, not part of the package: tests/loader/test_checkpoint_fuzz.py and the benchmark
import it from here.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import tempfile
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2, 32, 4, 2, 64, 64
HEAD_DIM = HIDDEN // HEADS
ALLOC_FACTOR, ALLOC_SLACK = 8, 32 << 20  # a tiny model dequantized to float32 fits well inside
HOSTILE_U64 = (0, 1, 2**31, 2**32 + 1, 2**40, 2**60, 2**63, 2**64 - 1)
HOSTILE_U32 = (0, 7, 9, 13, 31, 2**31, 2**32 - 1)


def _tensors(heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> dict[str, np.ndarray]:
    """Canonical names -> float32 arrays (torch layout), from a fixed seed."""
    rng = np.random.default_rng(0)
    shapes = {"embed_tokens.weight": (VOCAB, HIDDEN), "norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (heads * head_dim, HIDDEN),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, HIDDEN),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, HIDDEN),
                       p + "self_attn.o_proj.weight": (HIDDEN, heads * head_dim),
                       p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, FFN)})
    return {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in shapes.items()}


_GGUF_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(canonical: str) -> str:
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if canonical in top:
        return top[canonical]
    _, i, rest = canonical.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_GGUF_PARTS[part]}.{kind}"


# A SentencePiece-style vocabulary of VOCAB pieces: unknown, BOS, EOS, the word mark, letters, marked
# letters and a few pairs; and a chat template with a loop, a filter and a condition.
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_PAIRS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
TOKENS = ["<unk>", "<s>", "</s>", "\u2581", *_LETTERS, *("\u2581" + c for c in _LETTERS), *_PAIRS]
TOKEN_TYPES = [2, 3, 3] + [1] * (VOCAB - 3)
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] | upper }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>ASSISTANT:{% endif %}")


def write_tiny_gguf(path: Path, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> Path:
    """A valid tiny llama GGUF: F32 norms, Q8_0 matrices, a 64-piece SentencePiece tokenizer with a
    chat template; `heads` x `head_dim` need not be the hidden size (heads x head_dim a multiple of
    Q8_0's 32-value block)."""
    import gguf

    wr = gguf.GGUFWriter(path, "llama")
    wr.add_block_count(LAYERS)
    wr.add_context_length(256)
    wr.add_embedding_length(HIDDEN)
    wr.add_feed_forward_length(FFN)
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_rope_dimension_count(head_dim)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_tokenizer_model("llama")
    wr.add_token_list(TOKENS)
    wr.add_token_scores([-float(i) for i in range(VOCAB)])
    wr.add_token_types(TOKEN_TYPES)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(True)
    wr.add_chat_template(CHAT_TEMPLATE)
    for name, w in _tensors(heads, kv_heads, head_dim).items():
        if w.ndim == 2:
            wr.add_tensor(_gguf_name(name), gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            wr.add_tensor(_gguf_name(name), w)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def hf_config() -> dict:
    return {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


TOKENIZER_CONFIG = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}


def write_tiny_hf(directory: Path) -> Path:
    """A valid tiny Hugging Face directory: config.json, model.safetensors (float32), a BPE
    tokenizer.json over the same pieces, tokenizer_config.json and generation_config.json."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config()))
    merges = [(t[0], t[1:]) for t in _PAIRS] + [("\u2581", c) for c in _LETTERS]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS)}, merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.add_special_tokens(TOKENS[:3])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    save_file({"model." + n if n != "lm_head.weight" else n: w for n, w in _tensors().items()},
              str(directory / "model.safetensors"))
    return directory


# --- where the integers of a GGUF header are --------------------------------------------------

@dataclass(frozen=True)
class Field:
    offset: int
    width: int  # 4 or 8 bytes, little-endian unsigned
    role: str  # tensor_count, kv_count, strlen, vtype, etype, arrlen, value, n_dims, dim, ttype, toffset


def gguf_fields(data: bytes) -> list[Field]:
    """Every integer of a valid little-endian GGUF header, by role (written independently of the
    loader, so a bug there is not copied here)."""
    fields = [Field(8, 8, "tensor_count"), Field(16, 8, "kv_count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    off = 24
    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(off: int) -> int:
        fields.append(Field(off, 8, "strlen"))
        return off + 8 + struct.unpack_from("<Q", data, off)[0]

    def value(vtype: int, off: int) -> int:
        if vtype == 8:
            return string(off)
        if vtype in scalar:
            if scalar[vtype] in (4, 8):
                fields.append(Field(off, scalar[vtype], "value"))
            return off + scalar[vtype]
        etype, count = struct.unpack_from("<IQ", data, off)
        fields.extend([Field(off, 4, "etype"), Field(off + 4, 8, "arrlen")])
        off += 12
        for _ in range(count):
            off = value(etype, off)
        return off

    for _ in range(n_kv):
        off = string(off)
        fields.append(Field(off, 4, "vtype"))
        off = value(struct.unpack_from("<I", data, off)[0], off + 4)
    for _ in range(n_tensors):
        off = string(off)
        fields.append(Field(off, 4, "n_dims"))
        (n_dims,) = struct.unpack_from("<I", data, off)
        fields.extend(Field(off + 4 + 8 * d, 8, "dim") for d in range(n_dims))
        off += 4 + 8 * n_dims
        fields.extend([Field(off, 4, "ttype"), Field(off + 4, 8, "toffset")])
        off += 12
    return fields


def _set(data: bytes, f: Field, v: int) -> bytes:
    out = bytearray(data)
    out[f.offset:f.offset + f.width] = (v % (1 << (8 * f.width))).to_bytes(f.width, "little")
    return bytes(out)


# --- mutations ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mutation:
    name: str  # says what was done, e.g. "gguf arrlen@1234=2**40"
    apply: Callable[[Path], Path]  # writes the mutated checkpoint under a directory, returns its path


def _gguf_bytes_mutation(name: str, data: bytes) -> Mutation:
    def apply(d: Path) -> Path:
        p = d / "m.gguf"
        p.write_bytes(data)
        return p
    return Mutation(name, apply)


def _hf_mutation(name: str, seed: Path, file: str, data: bytes) -> Mutation:
    def apply(d: Path) -> Path:
        out = d / "hf"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(seed, out)
        (out / file).write_bytes(data)
        return out
    return Mutation(name, apply)


def _u64_name(v: int) -> str:
    return f"2**{v.bit_length() - 1}" if v > 1 and v & (v - 1) == 0 else str(v)


def gguf_mutations(seed: bytes, rng: random.Random, n_random: int) -> Iterator[Mutation]:
    """Hostile values in every header field of each role (every role's first two fields and a
    random other one), cuts at every field boundary and random ones, `n_random` bit flips
    (most in the header, where they matter)."""
    fields = gguf_fields(seed)
    header_end = max(f.offset + f.width for f in fields)
    by_role: dict[str, list[Field]] = {}
    for f in fields:
        by_role.setdefault(f.role, []).append(f)
    for role, fs in by_role.items():
        picks = fs[:2] + ([rng.choice(fs[2:])] if len(fs) > 2 else [])
        for f in picks:
            old = int.from_bytes(seed[f.offset:f.offset + f.width], "little")
            values = HOSTILE_U64 if f.width == 8 else HOSTILE_U32
            if role in ("strlen", "arrlen", "dim", "toffset"):
                values = values + (old + 1, old - 1, len(seed), len(seed) - f.offset)
            for v in values:
                if v != old:
                    yield _gguf_bytes_mutation(f"gguf {role}@{f.offset}={_u64_name(v)}", _set(seed, f, v))
    cuts = sorted({f.offset for f in fields} | {f.offset + f.width // 2 for f in fields}
                  | {rng.randrange(len(seed)) for _ in range(16)} | {0, 3, 4, 8, 23, len(seed) - 1})
    for c in cuts:
        yield _gguf_bytes_mutation(f"gguf cut@{c}", seed[:c])
    for _ in range(n_random):
        pos = rng.randrange(header_end) if rng.random() < 0.8 else rng.randrange(len(seed))
        out = bytearray(seed)
        out[pos] ^= 1 << rng.randrange(8)
        yield _gguf_bytes_mutation(f"gguf flip@{pos}", bytes(out))


def _safetensors_header(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<Q", data, 0)
    return json.loads(data[8:8 + n]), data[8 + n:]


def _safetensors_with(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def hf_mutations(seed_dir: Path, rng: random.Random, n_random: int) -> Iterator[Mutation]:
    """Hostile safetensors headers (lengths, offsets, shapes, dtypes), hostile config.json values
    and index files, cuts, and `n_random` bit flips in the safetensors file."""
    st = (seed_dir / "model.safetensors").read_bytes()
    header, body = _safetensors_header(st)
    names = [k for k in header if k != "__metadata__"]
    for v in HOSTILE_U64 + (len(st), len(st) - 8, 2):
        yield _hf_mutation(f"st header_len={_u64_name(v)}", seed_dir, "model.safetensors",
                           struct.pack("<Q", v) + st[8:])
    for name in (names[0], rng.choice(names)):
        entry = header[name]
        a, b = entry["data_offsets"]
        hostile = {
            "data_offsets=[-8,b]": {"data_offsets": [-8, b]},
            "data_offsets=[a,2**60]": {"data_offsets": [a, 2**60]},
            "data_offsets=[b,a]": {"data_offsets": [b, a]},
            "data_offsets=[0,b-a]": {"data_offsets": [0, b - a]},
            "data_offsets=[a,len]": {"data_offsets": [a, len(body) + 1]},
            "data_offsets=1": {"data_offsets": 1},
            "shape=[2**40,2**40]": {"shape": [2**40, 2**40]},
            "shape=[2**62]": {"shape": [2**62]},
            "shape=[-1]": {"shape": [-1]},
            "shape=[]": {"shape": []},
            "shape='x'": {"shape": "x"},
            "dtype=Q9": {"dtype": "Q9"},
            "dtype=F64": {"dtype": "F64"},
            "dtype=BOOL": {"dtype": "BOOL"},
            "dtype=7": {"dtype": 7},
        }
        for label, change in hostile.items():
            h = json.loads(json.dumps(header))
            h[name].update(change)
            yield _hf_mutation(f"st {name} {label}", seed_dir, "model.safetensors", _safetensors_with(h, body))
    for label, h in {"header=[]": [], "header=null": None, "no tensors": {"__metadata__": {}},
                     "metadata=1": {**header, "__metadata__": 1}}.items():
        yield _hf_mutation(f"st {label}", seed_dir, "model.safetensors", _safetensors_with(h, body))
    for c in sorted({0, 4, 8, 9, 8 + len(json.dumps(header)) // 2, len(st) - len(body), len(st) - 1}
                    | {rng.randrange(len(st)) for _ in range(8)}):
        yield _hf_mutation(f"st cut@{c}", seed_dir, "model.safetensors", st[:c])
    for _ in range(n_random):
        pos = rng.randrange(len(st) - len(body)) if rng.random() < 0.8 else rng.randrange(len(st))
        out = bytearray(st)
        out[pos] ^= 1 << rng.randrange(8)
        yield _hf_mutation(f"st flip@{pos}", seed_dir, "model.safetensors", bytes(out))
    cfg = hf_config()
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):
        for v in (0, -1, 2**40, 2**62, 3, "x", None, [1], 1.5):
            yield _hf_mutation(f"config {key}={v!r}", seed_dir, "config.json", json.dumps({**cfg, key: v}).encode())
    whole = {"config=[]": [], "config=1": 1, "config rope_scaling=1": {**cfg, "rope_scaling": 1},
             "config eos='x'": {**cfg, "eos_token_id": "x"},
             "config rope_scaling llama3 empty": {**cfg, "rope_scaling": {"rope_type": "llama3"}}}
    for label, value in whole.items():
        yield _hf_mutation(label, seed_dir, "config.json", json.dumps(value).encode())
    yield _hf_mutation("config not json", seed_dir, "config.json", b"{")
    yield from tokenizer_mutations(seed_dir, rng)
    for label, text in {"index not json": "{", "index=[]": "[]", "index weight_map=1": '{"weight_map": 1}',
                        "index outside the dir": '{"weight_map": {"model.norm.weight": "/etc/passwd"}}',
                        "index ../": '{"weight_map": {"model.norm.weight": "../model.safetensors"}}',
                        "index missing shard": '{"weight_map": {"model.norm.weight": "absent.safetensors"}}'}.items():
        yield _hf_mutation(label, seed_dir, "model.safetensors.index.json", text.encode())


def tokenizer_mutations(seed_dir: Path, rng: random.Random) -> Iterator[Mutation]:
    """tokenizer.json, tokenizer_config.json and generation_config.json of the wrong shape: not
    JSON, not objects, fields of the wrong type, hostile ids, templates that do not compile, cuts."""
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        for label, text in {"not json": "{", "[]": "[]", "1": "1", "null": "null", "empty": ""}.items():
            yield _hf_mutation(f"{file} {label}", seed_dir, file, text.encode())
    cfg = TOKENIZER_CONFIG
    for key, values in {"bos_token": (5, ["<s>"], {"content": 5}, {"content": None}, "absent"),
                        "eos_token": (5, {"content": ["x"]}, {}, "</s>" * 10000),
                        "chat_template": (5, [], [1, {"name": 3}], [{"name": "default", "template": 7}],
                                          "{% for %}", "{{ messages[10**9] }}", "{% raise %}")}.items():
        for v in values:
            yield _hf_mutation(f"tokenizer_config {key}={str(v)[:40]!r}", seed_dir, "tokenizer_config.json",
                               json.dumps({**cfg, key: v}).encode())
    for v in ("x", [[1]], 2**70, -1, [None, 2**40], {"a": 1}):
        yield _hf_mutation(f"generation_config eos={v!r}", seed_dir, "generation_config.json",
                           json.dumps({"eos_token_id": v}).encode())
    tj = json.loads((seed_dir / "tokenizer.json").read_text())
    hostile = {"model=1": {"model": 1}, "model type=Q": {"model": {**tj["model"], "type": "Q"}},
               "vocab id 2**40": {"model": {**tj["model"], "vocab": {**tj["model"]["vocab"], "zz": 2**40}}},
               "vocab id -1": {"model": {**tj["model"], "vocab": {**tj["model"]["vocab"], "zz": -1}}},
               "merges of unknown pieces": {"model": {**tj["model"], "merges": [["qq", "rr"]]}},
               "added token id 2**40": {"added_tokens": [{**tj["added_tokens"][0], "id": 2**40}]},
               "added_tokens=1": {"added_tokens": 1}, "truncation max 0": {"truncation": {"max_length": 0}},
               "pre_tokenizer=7": {"pre_tokenizer": 7}}
    for label, change in hostile.items():
        yield _hf_mutation(f"tokenizer.json {label}", seed_dir, "tokenizer.json", json.dumps({**tj, **change}).encode())
    raw = (seed_dir / "tokenizer.json").read_bytes()
    for c in sorted({rng.randrange(len(raw)) for _ in range(6)}):
        yield _hf_mutation(f"tokenizer.json cut@{c}", seed_dir, "tokenizer.json", raw[:c])


def mutations(work: Path, n_random: int = 64, seed: int = 0) -> list[Mutation]:
    """The GGUF and the safetensors mutations, with their seed files written under `work`."""
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    gguf_seed = write_tiny_gguf(work / "seed.gguf").read_bytes()
    hf_seed = write_tiny_hf(work / "seed_hf")
    return [*gguf_mutations(gguf_seed, rng, n_random), *hf_mutations(hf_seed, rng, n_random)]


# --- running one ------------------------------------------------------------------------------

def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def forward(model) -> None:
    """A prefill of 4 rows, then a decode row that reads them from the KV cache: every layer's
    kernels (the fused native layer where it qualifies, native attention, the packed matmuls) run
    on the shapes the file claims."""
    import torch

    from specpipe.model.runner import run_rows

    n = 4
    kv = model.make_kv_cache(n + 1)
    tokens = torch.arange(n + 1) % model.cfg.vocab_size
    run_rows(model, kv, tokens[:n], list(range(n)), list(range(n)), list(range(n)), np.tri(n, dtype=bool))
    run_rows(model, kv, tokens[n:], [n], [n], list(range(n + 1)), np.ones((1, n + 1), dtype=bool))


def _load(path: Path) -> None:
    from specpipe.config import StageSpec
    from specpipe.loader import open_checkpoint
    from specpipe.model.stage import build_stage
    from specpipe.tokenizer.tokenizer import Tokenizer

    ckpt = open_checkpoint(path)
    forward(build_stage(ckpt, StageSpec.whole(ckpt.config)))
    ckpt.close()
    tok = Tokenizer.from_path(path)
    tok.decode(tok.encode("ab cd efz"))
    if tok.has_chat_template:
        tok.apply_chat_template([{"role": "user", "content": "ab"}])


_warm = False


def _warm_up() -> None:
    """Load both seed files once, untraced, so the modules imported on first use (and their
    caches) do not count as the first mutation's allocation."""
    global _warm
    if not _warm:
        with tempfile.TemporaryDirectory() as d:
            _load(write_tiny_gguf(Path(d) / "w.gguf"))
            _load(write_tiny_hf(Path(d) / "w_hf"))
        _warm = True


def try_load(path: Path) -> tuple[str, str]:
    """(outcome, detail) of opening `path` and building the whole model from it, as serving does."""
    from specpipe.config import ConfigError
    from specpipe.loader import CheckpointError
    from specpipe.tokenizer.tokenizer import TokenizerError

    _warm_up()
    size = _size(path)
    tracemalloc.start()
    try:
        _load(path)
        outcome, detail = "loaded", ""
    except (CheckpointError, ConfigError, TokenizerError) as e:
        outcome, detail = "refused", str(e).splitlines()[0][:200]
    except MemoryError as e:  # an allocation so large it failed at once
        outcome, detail = "allocation", f"MemoryError: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - sorting every other exception is the point
        outcome, detail = "crash", f"{type(e).__name__}: {e}"[:300]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if peak > ALLOC_FACTOR * size + ALLOC_SLACK:
        outcome, detail = "allocation", f"peak {peak} bytes for a {size}-byte checkpoint ({detail})"
    return outcome, detail
