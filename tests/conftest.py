"""Shared fixtures: tiny random-weight Hugging Face model directories.

Each directory is what `save_pretrained` writes (config.json, model.safetensors,
generation_config.json) plus a byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json
with a ChatML chat template), so it can be opened by `specpipe.loader.open_checkpoint`,
`specpipe.tokenizer.tokenizer.Tokenizer.from_path` and transformers alike.

Fixtures (session-scoped; treat the directories as read-only, copy them to modify):
  tiny_llama_dir   -- Llama, 4 layers, hidden 64, 4 heads / 2 KV heads, vocab 300
  tiny_qwen2_dir   -- the same shape as Qwen2 (biases on q/k/v)
  tiny_model_dir   -- factory: tiny_model_dir("llama", tie_word_embeddings=True, ...) -> Path,
                      cached per distinct set of arguments; arch is any key of TINY_FAMILIES
                      (a transformers model_type), with that family's features switched on

The weights are drawn with a larger spread than transformers' default (initializer_range 0.2,
non-trivial norm weights and biases) so that logits are far from ties and every tensor matters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest

# Every engine in the tests checks its speculative requests' records after each step
# (engine/modes/draft_progress.py); read when specpipe is first imported, so set before that.
os.environ.setdefault("SPECPIPE_CHECK_STATE", "1")

TINY_VOCAB = 300
TINY_SHAPE = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)

# Tokenizer layout: ids 0..255 are the byte-level symbols (id == byte value), then the merges'
# results, then the special tokens; everything stays below TINY_VOCAB.
TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
               ("Ġ", "s"), ("r", "e"), ("a", "t")]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable character standing for each byte 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_tokenizer_ids() -> dict[str, int]:
    """token -> id of the tiny tokenizer (bytes, merged tokens, specials)."""
    vocab = {s: i for i, s in enumerate(byte_symbols())}
    for a, b in TINY_MERGES:
        vocab.setdefault(a + b, len(vocab))
    for s in SPECIAL_TOKENS:
        vocab[s] = len(vocab)
    assert len(vocab) <= TINY_VOCAB
    return vocab


def write_tiny_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = byte_symbols()
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    ids = tiny_tokenizer_ids()
    base = {t: i for t, i in ids.items() if t not in SPECIAL_TOKENS}
    tok = Tokenizer(models.BPE(vocab=base, merges=list(TINY_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Added in id order, so each gets the next free id: the ones tiny_tokenizer_ids() promises.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    for s in SPECIAL_TOKENS:
        assert tok.token_to_id(s) == ids[s], s
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": TINY_SHAPE["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }, indent=2))


# DeepSeek's latent attention at the tiny shape: 4 heads of 16 + 8 (RoPE) query dims, values of 16,
# a latent of 32 (the cache holds 32 + 8 values a token a layer), 8 routed experts of width 32,
# top-2, a dense first layer.
DEEPSEEK_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)

# Every family's own features switched on at the tiny shape: a head dim other than hidden / heads,
# several experts with top-2 (one dense layer among sparse ones), a sliding window shorter than
# the test prompts on alternate layers, partial rotary with LongRoPE past its original context.
TINY_FAMILIES = {
    "llama": {}, "qwen2": {}, "mistral": {},
    "qwen3": dict(head_dim=32),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "gemma3_text": dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=6, hidden_activation="gelu_pytorch_tanh"),
    "phi3": dict(partial_rotary_factor=0.5, original_max_position_embeddings=16, max_position_embeddings=256,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6],
                               "long_factor": [1.0, 2.0, 4.0, 8.0]}),
    # GLM-4.5: a dense first layer, then 8 experts in 2 groups (top-1 group, top-2 experts), a
    # shared expert, sigmoid scores with a correction bias, scaled weights; QKV bias, q/k norm,
    # half of a 32-wide head rotating.
    "glm4_moe": dict(head_dim=32, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                     first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                     n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
    # MiniMax-M2: every layer sparse (8 experts, top-2, sigmoid with a correction bias), q/k norm
    # over the whole projection, 16 of 32 dims rotating (its files say rotary_dim).
    "minimax_m2": dict(head_dim=32, rotary_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    **{family: dict(DEEPSEEK_MLA, **moe) for family, moe in (
        # V2-Lite's layout: no query LoRA, softmax routing (greedy), two shared experts; YaRN with
        # V2-Lite's mscale 0.707 (the softmax scale changes too); its original context 64.
        ("deepseek_v2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy", rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})),
        # V3's: query LoRA, sigmoid scores with a correction bias, 4 groups of which the best 2 are
        # searched, renormalised and scaled weights, one shared expert, interleaved RoPE, YaRN.
        ("deepseek_v3", dict(q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                             routed_scaling_factor=2.5, rope_interleave=True, rope_scaling={
                                 "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})))},
}
# Routers that score by sigmoid: the reference spread (logits of std ~8) would pin every score at
# 0 or 1, so they get logits of std ~1 and a correction bias that changes some choices.
SIGMOID_ROUTED = ("glm4_moe", "minimax_m2", "deepseek_v3")


def _config(arch: str, **overrides):
    from transformers import AutoConfig

    eos = tiny_tokenizer_ids()["<|endoftext|>"]
    kwargs = dict(TINY_SHAPE, **TINY_FAMILIES[arch])
    kwargs.update(bos_token_id=None, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    kwargs.update(overrides)
    if arch == "gemma3_text" and "layer_types" not in kwargs:  # sliding, global, sliding, global, ...
        kwargs["layer_types"] = ["full_attention" if i % 2 else "sliding_attention"
                                 for i in range(kwargs["num_hidden_layers"])]
    return AutoConfig.for_model(arch, **kwargs)


def make_tiny_hf_model(arch: str = "llama", seed: int = 0, **config_overrides):
    """A random-weight transformers model (fp32, eval mode) of the tiny shape."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # default 1: make them matter
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):  # default 0: make Qwen2's biases matter
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # a router far from ties, so top-2 is not a coin toss
                p.copy_(torch.randn(p.shape, generator=gen) * (0.15 if arch in SIGMOID_ROUTED else 1.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # default 0: make the selection bias matter
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model.eval()


def write_tiny_model_dir(directory: Path, arch: str = "llama", seed: int = 0,
                         max_shard_size: str | None = None, **config_overrides) -> Path:
    """Save a tiny random model (+ tokenizer) into `directory` and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    model = make_tiny_hf_model(arch, seed, **config_overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Callable[..., Path]:
    """Factory fixture: tiny_model_dir(arch="llama", seed=0, max_shard_size=None, **config) -> Path."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", seed: int = 0, max_shard_size: str | None = None, **config_overrides) -> Path:
        key = json.dumps([arch, seed, max_shard_size, config_overrides], sort_keys=True)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = write_tiny_model_dir(d, arch, seed, max_shard_size, **config_overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model's checkpoint (SmolLM2-135M Q4_1), or a skip saying it is missing."""
    from specpipe.loader import open_checkpoint
    from specpipe.loader.default_model import DefaultModelMissing, default_model_path

    try:
        return open_checkpoint(default_model_path())
    except DefaultModelMissing as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="session")
def thinking_server(tiny_model_dir, tmp_path_factory):
    """One in-process server (tests/entrypoints/live_app.py) over the tiny model with a reasoning
    model's template, shared by the reasoning, tool-format, Anthropic and Responses tests. Here and
    not in a conftest of tests/entrypoints: a second conftest.py would shadow this one for the tests
    that import it by name (`from conftest import ...`)."""
    from live_app import LiveServer, engine_of, thinking_model  # tests/entrypoints is on sys.path for its tests

    engine = engine_of(thinking_model(tiny_model_dir, tmp_path_factory.mktemp("thinking")))
    server = LiveServer(engine)
    yield server
    server.stop()
    engine.close()


@pytest.fixture
def split_every_call():
    """Every native matmul call takes the threads it is given: the thread-invariance tests use
    matrices far below the size under which the library runs a call on one thread (2 MiB of
    weights x rows), so without this they would not run the split paths at all."""
    from specpipe.kernels import native

    if not native.available():
        yield
        return
    native.set_parallel_min_bytes(0)
    yield
    native.set_parallel_min_bytes(2 << 20)
