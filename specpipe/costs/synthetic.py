"""A checkpoint of random weights in the real GGML block formats, for profiling models whose files
are not here (`specpipe profile --synthetic NAME`, docs/design.md §10).

A decoder layer's time on a CPU depends on its shapes and its weights' block types, not on their
values (the native kernels have no data-dependent shortcuts; the values are kept finite and of a
trained model's scale so that no NaN or inf reaches them). So a stage built from random blocks of
the types a GGUF file would hold, through the same `build_stage` (stacked projections, the fused
native layer), costs what the real file's stage costs: `SyntheticCheckpoint` is such a file,
tensor by tensor, generated when a stage loads it (only the stage's layers ever exist).

The type mix (`q4_k_m`) is llama.cpp's Q4_K_M rule (llama-quant.cpp, llama_tensor_get_type):
  token_embd Q4_K, output Q6_K; attn_v and ffn_down Q6_K where use_more_bits(i, n) (the first
  and last eighth of the layers and every third one between), Q4_K otherwise; every other
  projection Q4_K; norms, biases and the MoE router F32. A K-quant needs rows of multiples of
  256 values: where the input width is not, Q4_K falls back to Q5_0 and Q6_K to Q8_0.
  The i of use_more_bits counts attn_v (and dense ffn_down) tensors in the order the file holds
  them, and convert_hf_to_gguf.py writes them in the checkpoint's order, whose layer numbers
  sort as strings (0, 1, 10, 11, ..., 19, 2, 20, ...); for the experts' ffn_down i is the layer
  number itself. Checked against both Qwen2.5-Coder files (1.5B and 0.5B, every tensor).
A single type name instead (`q8_0`, `q4_0`, ...) gives every projection, the head and the
embedding that type.

A sparse MLP (Qwen3-MoE, Mixtral) holds every expert, as the file does; a row runs only the
top-k experts its router picks (model/moe.py), so a step of n rows reads about
E * (1 - (1 - k/E)^n) experts of E. The router's weights are random, so its picks are spread
evenly over the experts (a trained router is less even: fewer distinct experts for several rows).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch

from specpipe.config import ModelConfig, StageSpec
from specpipe.kernels.ggml_types import FLOAT_TYPES, LAYOUTS
from specpipe.loader.checkpoint import Checkpoint

Q = gguf.GGMLQuantizationType
QK_K = 256
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}  # a K-quant on rows not of 256 values

# config.json fields (as Hugging Face publishes them) of the models the presets name.
PRESETS: dict[str, dict] = {
    "qwen2.5-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, rope_theta=1e6,
                        rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False),
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                          rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                          tie_word_embeddings=False),
    # DeepSeek-V3 (671B; R1 and V3.1 share the shapes) and GLM-4.6 (355B), their published config.json
    # (deepseek-ai/DeepSeek-V3, zai-org/GLM-4.6) as recalled, not read from the files here: the
    # multi-token-prediction layer (num_nextn_predict_layers 1) is not in a stage and is left out;
    # GLM-4.6's use_qk_norm true and max_position_embeddings 202752 are the least certain fields.
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8,
                        n_shared_experts=1, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                        norm_topk_prob=True, routed_scaling_factor=2.5, moe_layer_freq=1, num_attention_heads=128,
                        num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=163840, tie_word_embeddings=False,
                        rope_scaling=dict(type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
                                          mscale_all_dim=1.0, original_max_position_embeddings=4096)),
    "glm-4.6": dict(model_type="glm4_moe", hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                    num_hidden_layers=92, first_k_dense_replace=3, n_routed_experts=160, num_experts_per_tok=8,
                    n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                    num_attention_heads=96, num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5,
                    attention_bias=True, use_qk_norm=True, vocab_size=151552, rms_norm_eps=1e-5, rope_theta=1e6,
                    max_position_embeddings=202752, tie_word_embeddings=False),
    # The pair this repository measures for real, for checking the synthetic profile against them.
    "qwen2.5-coder-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6,
                               rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False),
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1e6,
                               rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False),
}
# The GGUF files keep an output tensor even where config.json ties it (the Qwen2.5-Coder files do):
# the presets above say tie_word_embeddings False so the head is its own Q6_K tensor, as there.


def scaled_experts(fields: dict, experts: int) -> dict:
    """A config.json's fields with `experts` routed experts instead of its own, every expert's
    shape, the top k and the groups kept: a layer a machine can hold whose step reads what the
    real layer's step reads for as many distinct experts (not for as many rows: fewer experts
    are all read by fewer rows, so a profile of it records the experts each row count read)."""
    key = next((k for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in fields), None)
    if key is None:
        raise ValueError("only a mixture of experts has experts to scale")
    groups = int(fields.get("n_group") or 1)
    if experts % groups or experts // groups * int(fields.get("topk_group") or 1) < int(fields["num_experts_per_tok"]):
        raise ValueError(f"{experts} experts do not fill {groups} groups with the top-k's experts")
    return {**fields, key: experts}


def model_config(name: str) -> tuple[str, ModelConfig]:
    """(a short name, the ModelConfig) of a preset or of a Hugging Face config.json path; a
    preset's name ending in `:eN` keeps N of its routed experts (scaled_experts)."""
    from specpipe.config import ConfigError
    from specpipe.loader.hf_config import model_config_from_hf

    base, _, experts = name.partition(":e")
    if base in PRESETS and experts.isdigit():
        try:
            return name, model_config_from_hf(scaled_experts(PRESETS[base], int(experts)))
        except ValueError as e:
            raise ConfigError(f"--synthetic {name}: {e}") from None
    if name in PRESETS:
        return name, model_config_from_hf(PRESETS[name])
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--synthetic: {name!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--synthetic: cannot read {path}: {e}") from None
    return path.parent.name or path.stem, model_config_from_hf(data)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the tensors that get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def file_position(layer: int, num_layers: int) -> int:
    """Where layer `layer`'s tensors come among the layers in a converted GGUF file (numbers sorted
    as strings)."""
    return sorted(range(num_layers), key=str).index(layer)


def _fits(qtype: Q, in_features: int) -> Q:
    return FALLBACK[qtype] if qtype in FALLBACK and in_features % QK_K else qtype


def tensor_types(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], mix: str = "q4_k_m") -> dict[str, Q]:
    """The GGML type of every tensor (canonical name -> type) under `mix`: q4_k_m (module
    docstring) or one type's name for every matrix."""
    mix = mix.lower()
    uniform = None
    if mix != "q4_k_m":
        try:
            uniform = Q[mix.upper()]
        except KeyError:
            raise ValueError(f"type mix must be q4_k_m or a GGML type (q8_0, q4_0, q4_k, ...), got {mix!r}") from None
    L = cfg.num_layers
    positions = {layer: pos for pos, layer in enumerate(sorted(range(L), key=str))}
    out = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        if len(shape) != 2 or name.endswith(".mlp.gate.weight"):  # norms, biases, the router
            out[name] = Q.F32
            continue
        if uniform is not None:
            out[name] = uniform
            continue
        if name == "lm_head.weight":
            qtype = Q.Q6_K
        elif parts[0] == "layers" and (name.endswith("v_proj.weight") or name.endswith("down_proj.weight")):
            layer = int(parts[1])
            i = layer if ".experts." in name else positions[layer]
            qtype = Q.Q6_K if use_more_bits(i, L) else Q.Q4_K
        else:
            qtype = Q.Q4_K
        out[name] = _fits(qtype, shape[1])
    return out


def _f16(x: float) -> np.float16:
    return np.float16(max(float(x), 6.2e-5))  # a normal half: no subnormal on any kernel's path


def random_blocks(qtype: Q, rows: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8: random blocks of `qtype` whose weights have about a trained
    layer's spread (std ~ 1/sqrt(in_features)) and mean ~0; every scale a normal f16."""
    layout = LAYOUTS[qtype]
    nblocks = rows * in_features // layout.values
    # In a bytearray, as the GGUF loader reads a tensor (loader/checked_file.py): where the
    # weights live matters. numpy's own arrays of this size get transparent huge pages (numpy
    # asks for them), a bytearray does not, and a one-row step streaming a 191 MB head from huge
    # pages was 13-18% faster (docs/benchmarks.md, section 8).
    buf = bytearray(nblocks * layout.size)
    blocks = np.frombuffer(buf, np.uint8).reshape(nblocks, layout.size)
    blocks[:] = np.frombuffer(rng.bytes(len(buf)), np.uint8).reshape(nblocks, layout.size)
    want = in_features ** -0.5

    def put(field: str, value) -> None:
        off, n = layout.fields[field]
        blocks[:, off:off + n] = np.asarray(value).reshape(-1, 1).view(np.uint8) if np.ndim(value) == 0 else value

    # Per type: the std of a weight with its scale d = 1 (random fields), and the other scales
    # chosen so the mean is ~0: Q4_K w = d*sc*q - dmin*m (sc, m in 0..63, q in 0..15), etc.
    if qtype in (Q.Q4_K, Q.Q5_K):
        levels = 7.5 if qtype == Q.Q4_K else 15.5
        spread = 258.0 if qtype == Q.Q4_K else 520.0
        d = _f16(want / spread)
        put("d", d)
        put("dmin", _f16(float(d) * levels))
    elif qtype == Q.Q6_K:
        off, n = layout.fields["scales"]
        blocks[:, off:off + n] = rng.integers(-16, 17, (nblocks, n), dtype=np.int8).view(np.uint8)
        put("d", _f16(want / 176.0))
    elif qtype == Q.Q8_0:
        put("d", _f16(want / 73.9))
    elif qtype in (Q.Q4_0, Q.Q5_0):
        put("d", _f16(want / (4.6 if qtype == Q.Q4_0 else 9.2)))
    elif qtype in (Q.Q4_1, Q.Q5_1):
        d = _f16(want / (4.6 if qtype == Q.Q4_1 else 9.2))
        put("d", d)
        put("m", np.float16(-float(d) * (7.5 if qtype == Q.Q4_1 else 15.5)))
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks.reshape(rows, -1)


class SyntheticCheckpoint(Checkpoint):
    """Random weights of `cfg`'s shapes in `mix`'s block types; each tensor made (seeded by its
    name) when a stage loads it."""

    def __init__(self, name: str, cfg: ModelConfig, mix: str = "q4_k_m", seed: int = 0) -> None:
        from specpipe.model.llama import LlamaStage

        self.path, self.config, self.mix, self.seed = Path(f"synthetic-{name}"), cfg, mix, seed
        with torch.device("meta"):  # the whole model's names and shapes, without its memory
            model = LlamaStage(cfg, StageSpec.whole(cfg))
        self._shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.types = tensor_types(cfg, self._shapes, mix)

    def names(self) -> set[str]:
        return set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def _rng(self, name: str) -> np.random.Generator:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "little"))

    def load(self, name: str, dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
        shape = self._shapes[name]
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            # The router's selection bias too: a trained one balances the experts' load, a random
            # one would favour some (W random rows read fewer distinct experts than E(1-(1-k/E)^W)).
            t = torch.zeros(shape)
        else:  # a float matrix (the router): a trained layer's spread
            t = torch.from_numpy(self._rng(name).standard_normal(shape, dtype=np.float32)) * shape[-1] ** -0.5
        return t.to(dtype or torch.float32)

    def load_packed(self, name: str):
        qtype = self.types[name]
        if qtype in FLOAT_TYPES:
            return None
        rows, cols = self._shapes[name]
        return qtype, torch.from_numpy(random_blocks(qtype, rows, cols, self._rng(name))), (rows, cols)

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes in its type."""
        values, size = gguf.GGML_QUANT_SIZES[self.types[name]]
        return int(np.prod(self._shapes[name])) // values * size


def weight_bytes(ckpt: Checkpoint, nbytes) -> dict:
    """What a token reads, by part: the mean decoder layer (every expert, and the top-k experts a
    row reads), the LM head (with the final norm) and the embedding matrix (of which a token reads
    one row). `nbytes(name)`: a tensor's bytes."""
    cfg = ckpt.config
    layers = [0] * cfg.num_layers
    experts = [0] * cfg.num_layers  # bytes of all experts, per layer
    head = embed = 0
    for name in ckpt.names():
        b = nbytes(name)
        parts = name.split(".")
        if parts[0] == "layers":
            layers[int(parts[1])] += b
            if ".experts." in name:
                experts[int(parts[1])] += b
        elif name in ("lm_head.weight", "norm.weight"):
            head += b
        elif name == "embed_tokens.weight":
            embed = b
    if "lm_head.weight" not in ckpt.names():
        head += embed  # tied: the head reads the embedding's bytes
    L = cfg.num_layers
    active = [lb - eb + (eb * cfg.moe.top_k // cfg.moe.num_experts if cfg.moe else 0)
              for lb, eb in zip(layers, experts)]
    kv = cfg.kv_values_per_token * 4  # float32 K and V (or MLA's latent) per token, per layer
    return {"layer_bytes_mean": sum(layers) / L, "layer_bytes_active_mean": sum(active) / L,
            "head_bytes": head, "embed_bytes": embed, "kv_bytes_per_token_layer": kv,
            "total_bytes": sum(layers) + head + (embed if "lm_head.weight" in ckpt.names() else 0)}


def type_counts(ckpt: SyntheticCheckpoint, layers: range) -> dict[str, int]:
    """How many matrices of each type the given layers hold."""
    out: dict[str, int] = {}
    for name, qtype in ckpt.types.items():
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) in layers and qtype not in FLOAT_TYPES:
            out[qtype.name] = out.get(qtype.name, 0) + 1
    return out
