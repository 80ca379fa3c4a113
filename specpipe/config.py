"""Small validated configuration types shared by the loaders, the model and the engine.

Glossary:
  ModelConfig  -- the architecture of a decoder (Llama, Qwen2/3, Mistral, Mixtral, Qwen3-MoE,
                  Gemma 3, Phi-3), independent of file format; the families differ only in the
                  named options below (model/llama.py reads them). Built from a Hugging Face
                  config.json by loader/hf_config.py and from GGUF metadata by loader/gguf.py.
  MoEConfig    -- the sparse mixture-of-experts MLP of Mixtral / Qwen3-MoE / DeepSeek layers.
  MLAConfig    -- DeepSeek's multi-head latent attention and its latent KV cache.
  EngineConfig -- what the user chose: model, mode, stages, speculation, KV and batching limits.
  StageSpec    -- which slice of the model one pipeline stage holds: layers [start, end),
                  plus the token embedding (first stage) and final norm + LM head (last stage).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Optional

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "gemma3", "phi3", "glm4_moe",
                           "minimax_m2", "deepseek_v2", "deepseek_v3", "gpt_oss")
MODES = ("pp", "pp-cb", "tree", "specpipe", "specpipe-db")
# Modes whose requests share a row budget per step, with chunked prefill (and, for specpipe-db,
# tree widths that shrink as the pipeline fills); the others send exactly what their rule asks.
BUDGETED_MODES = ("pp-cb", "specpipe-db")
SPECULATIVE_MODES = ("tree", "specpipe", "specpipe-db")
DEFAULT_DRAFT = "ngram"
MAX_LAYERS_PER_STEP = 16


class ConfigError(ValueError):
    """A configuration that cannot work; the message is meant for the user."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class LinearRope:
    """Positions divided by `factor` ("rope_type": "linear"; Gemma 3's global layers)."""

    factor: float


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE ("rope_type": "longrope" / "su"): per-frequency divisors, one set for
    contexts within the original training length and one beyond it, and cos/sin scaled by
    `attention_factor`. Which set is used is fixed for the model (`long`), never chosen per
    batch: Hugging Face switches when a sequence grows past original_max_position (re-rotating
    nothing already cached), llama.cpp picks by the context size it serves; we take the long set
    when the served context (max_position) exceeds the original length, as llama.cpp does."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position: int
    attention_factor: float
    long: bool

    @property
    def factors(self) -> tuple[float, ...]:
        return self.long_factor if self.long else self.short_factor


@dataclass(frozen=True)
class YarnRope:
    """YaRN ("rope_type": "yarn"; DeepSeek V2/V3): frequencies blended between the original and
    divided by `factor` along a ramp between the dims that turn beta_fast and beta_slow times over
    the original context, and cos/sin scaled by `attention_factor` (model/rope.py)."""

    factor: float
    original_max_position: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1): of cos/sin
    (YarnRope.attention_factor) and, for latent attention, of the softmax (MLAConfig.softmax_scale)."""
    return 1.0 if factor <= 1 else 0.1 * float(mscale) * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek V2/V3, model/mla.py). A token's KV is one latent of
    kv_lora_rank values plus a RoPE key of qk_rope_head_dim values shared by every head; queries
    have qk_nope_head_dim + qk_rope_head_dim dims a head, values v_head_dim."""

    q_lora_rank: Optional[int]  # None: a plain q_proj (V2-Lite); else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # RoPE on interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's weights are laid out
    softmax_scale: float  # qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when scaled

    def __post_init__(self) -> None:
        sizes = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(sizes) <= 0 or self.qk_rope_head_dim % 2 or (self.q_lora_rank is not None and self.q_lora_rank <= 0):
            raise ConfigError(f"model config: bad latent attention sizes {self}")

    @property
    def latent_dim(self) -> int:
        """Values a token keeps in the cache per layer: the latent and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MLP: a router picks `top_k` of `num_experts` SwiGLU experts per row (the rule:
    model/routing.py). The defaults are Mixtral's / Qwen3-MoE's router; DeepSeek V2/V3, GLM-4.5
    and MiniMax-M2 set the fields below them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # renormalise the chosen experts' weights to sum 1 (Mixtral always)
    layers: tuple[int, ...]  # the layers whose MLP is sparse; the others are dense
    scoring: str = "softmax"  # softmax (Mixtral, Qwen3-MoE, DeepSeek V2) | sigmoid (DeepSeek V3, GLM-4.5, MiniMax-M2)
    correction_bias: bool = False  # e_score_correction_bias added to the scores to choose, never to weigh
    num_groups: int = 1  # experts in this many equal groups (n_group); 1 = no groups
    top_groups: int = 1  # a row chooses only within its best topk_group groups
    group_score: str = "top2_sum"  # a group's score: sum of its best two (V3, GLM) | max (V2)
    scaling_factor: float = 1.0  # routed_scaling_factor: the chosen weights times this
    shared_intermediate_size: int = 0  # an always-on shared expert of this width (0 = none)
    # gpt-oss: scoring "topk_softmax" (the top_k logits chosen, then softmaxed among themselves),
    # a bias on the router's logits, biases on every expert projection, and the clamped SwiGLU
    # (model/moe.py clamped_swiglu) when swiglu_limit is set
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts or self.intermediate_size <= 0:
            raise ConfigError(f"model config: bad mixture of experts {self}")
        if self.scoring not in ("softmax", "sigmoid", "topk_softmax") or self.group_score not in ("top2_sum", "max"):
            raise ConfigError(f"model config: unknown expert scoring {self.scoring!r} / group score {self.group_score!r}")
        groups, per_group = self.num_groups, self.num_experts // max(self.num_groups, 1)
        if (groups < 1 or self.num_experts % groups or not 1 <= self.top_groups <= groups
                or self.top_groups * per_group < self.top_k or (self.group_score == "top2_sum" and groups > 1
                                                                 and per_group < 2)):
            raise ConfigError(f"model config: {self.num_experts} experts cannot be chosen {self.top_k} at a time "
                              f"from the best {self.top_groups} of {groups} groups")
        if self.shared_intermediate_size < 0:
            raise ConfigError(f"model config: bad shared expert width {self.shared_intermediate_size}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling | LinearRope | LongRope | YarnRope] = None  # of the global layers
    max_position: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    o_proj_bias: bool = False  # gpt-oss: on the output projection too
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head in each softmax's denominator
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Where the families differ (defaults: Llama). Each is one named place in model/llama.py.
    qk_norm: bool = False  # Qwen3, Gemma 3, GLM-4.5 (use_qk_norm): RMSNorm over each query and key head, before RoPE
    qk_norm_whole: bool = False  # MiniMax-M2: that RMSNorm over the whole q / k projection (all heads at once)
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False  # Gemma 3: norms after attention and around the MLP as well
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    query_scale: Optional[float] = None  # scores' scale; None = 1/sqrt(head_dim)
    rope_dim: Optional[int] = None  # rotated dims of a head (Phi-3 partial rotary); None = head_dim
    sliding_window: Optional[int] = None  # the sliding layers see the last `sliding_window` positions
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: Optional[float] = None  # RoPE base of the sliding layers (Gemma 3), unscaled
    final_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap)
    moe: Optional[MoEConfig] = None
    # DeepSeek V2/V3: latent attention instead of per-head K/V (model/mla.py); then num_kv_heads
    # is 1 (the latent, which every query head reads) and head_dim the RoPE dims of a head.
    mla: Optional[MLAConfig] = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.arch!r}; SpecPipe runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"model config: unsupported activation {self.hidden_act!r} (silu, gelu_tanh)")
        if self.rope_dim is not None and not (0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise ConfigError(f"model config: rope_dim {self.rope_dim} must be even and in (0, {self.head_dim}]")
        if self.sliding_layers and not self.sliding_window:
            raise ConfigError("model config: sliding layers without a sliding window")

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def kv_values_per_token(self) -> int:
        """Values one token keeps in one layer's KV cache: K and V of every KV head, or with latent
        attention the latent and its RoPE key (576 for DeepSeek V3, not 128 heads x 2 x 192)."""
        return self.mla.latent_dim if self.mla is not None else 2 * self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return layer in self.sliding_layers

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers


@dataclass(frozen=True)
class StageSpec:
    """The part of the model one pipeline stage holds."""

    start: int  # first layer (inclusive)
    end: int  # last layer (exclusive)
    first: bool  # holds the token embedding
    last: bool  # holds the final norm and the LM head

    @staticmethod
    def whole(cfg: ModelConfig) -> "StageSpec":
        return StageSpec(0, cfg.num_layers, True, True)


@dataclass(frozen=True)
class LinkOptions:
    """The link between ranks: emulated latency and bandwidth (for rehearsing a slow network) and
    how long the driver waits for a step's results."""

    delay_ms: float = 0.0  # emulated one-way latency per message
    bandwidth_mbps: float = 0.0  # emulated link bandwidth in megabits/s; 0 = unlimited
    timeout_s: float = 30.0  # how long the driver waits for a step's results
    encrypt: bool = False  # bodies encrypted on the wire (--link-encryption), not only authenticated

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.bandwidth_mbps < 0 or self.timeout_s <= 0:
            raise ValueError("link delay and bandwidth must be >= 0 and the timeout > 0")

    @property
    def emulated(self) -> bool:
        return self.delay_ms > 0 or self.bandwidth_mbps > 0


@dataclass
class EngineConfig:
    model: Optional[str] = None  # GGUF file or HF directory; None = the embedded default model
    mode: str = "pp"
    stages: int = 1  # --cluster ray: at most this many, planned over the nodes (0: one per node)
    stage_layers: Optional[list[int] | str] = None  # layers per stage, or "balanced" (by --cost-profile)
    draft: Optional[str] = None  # source spec (see spec_decode/build.py); tree/specpipe default: ngram
    draft_vocab: Optional[int] = None  # a draft model proposes from about this many tokens (None: all)
    draft_quantization: Optional[str] = None  # int8 | int4: a draft model's weights requantized at load
    draft_async: bool = False  # a draft model runs on its own thread; no step waits for it (specpipe modes)
    tree_width: int = 8  # W: nodes per tree layer
    tree_depth: int = 4  # D: layers per round in mode `tree`
    layers_per_step: int | str = 1  # d: tree layers per step in specpipe / specpipe-db, or "auto"
    cost_profile: Optional[str] = None  # auto: a profile file or shipped name pricing rows and drafts
    max_context: int = 4096  # tokens of prompt + output a request may hold
    device: str = "cpu"
    dtype: str = "auto"  # auto = float32 activations, weights as stored on CPU; bfloat16 on CUDA
    quantization: Optional[str] = None  # int8 | int4: float (HF) weights to Q8_0 / Q4_0 at load
    transport: str = "auto"  # inproc | processes; auto = inproc for one stage, processes for more
    stage_threads: int = 0  # CPU threads per local stage process; 0 = usable cores / stages (cpus.py)
    link_delay_ms: float = 0.0  # emulated per-message link latency between ranks
    link_bandwidth_mbps: float = 0.0  # emulated link bandwidth; 0 = unlimited
    stage_timeout_s: float = 30.0  # a stage silent this long fails the in-flight requests
    restart_stages: int = 3  # stage processes or actors: start them again this often in a row after one dies; 0 = never
    cluster: str = "local"  # local (this machine, or torchrun ranks) | ray (stages as actors on a Ray cluster)
    ray_address: str = "auto"  # --cluster ray: the cluster to join (auto: the one `ray start` made here)
    weight_chunk: Optional[str] = None  # --cluster ray: streamed weight chunk, e.g. "256KiB" (None: $SPECPIPE_WEIGHT_CHUNK, else 8 MiB)
    weight_cache_max: Optional[str] = None  # --cluster ray: a node's weight cache cap, SIZE or N% (None: 50%)
    cluster_key_file: Optional[str] = None  # a file holding the pipeline's secret (required under torchrun)
    link_encryption: bool = False  # encrypt what crosses the links between ranks, not only authenticate it
    max_num_seqs: int = 32  # requests in the pipeline at once (more wait in a queue)
    max_step_rows: int = 64  # pp-cb / specpipe-db: rows entering stage 1 per step (prefill chunks included)
    max_waiting: int = 1024  # requests waiting beyond that are refused (QueueFull)
    max_waiting_per_client: Optional[int] = None  # of those, one client's (key/address) at most; None = half
    block_size: int = 16  # KV slots per block
    kv_memory: Optional[str] = None  # KV cache per stage, e.g. "2GiB"; None = kv_memory_fraction of free memory
    kv_memory_fraction: float = 0.25
    enable_prefix_caching: bool = True  # reuse the KV of prompt prefixes computed before (--no-prefix-caching)

    def link(self) -> LinkOptions:
        return LinkOptions(self.link_delay_ms, self.link_bandwidth_mbps, self.stage_timeout_s, self.link_encryption)

    def uses_processes(self) -> bool:
        return self.transport == "processes" or (self.transport == "auto" and self.stages > 1)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.stages < (0 if self.cluster == "ray" else 1):  # ray: 0 = one stage per node
            raise ConfigError(f"--stages must be at least 1, got {self.stages}")
        if self.tree_width < 1:
            raise ConfigError(f"--tree-width must be at least 1, got {self.tree_width}")
        if self.tree_depth < 1:
            raise ConfigError(f"--tree-depth must be at least 1, got {self.tree_depth}")
        if self.layers_per_step != "auto" and not (isinstance(self.layers_per_step, int)
                                                    and 1 <= self.layers_per_step <= MAX_LAYERS_PER_STEP):
            raise ConfigError(f"--layers-per-step must be auto or an integer in [1, {MAX_LAYERS_PER_STEP}], "
                              f"got {self.layers_per_step!r}")
        if isinstance(self.stage_layers, str) and self.stage_layers != "balanced":
            raise ConfigError(f"--stage-layers must be layer counts or balanced, got {self.stage_layers!r}")
        if self.stage_layers == "balanced" and self.cost_profile is None:
            raise ConfigError("--stage-layers balanced needs a --cost-profile to balance the stages by")
        if self.cost_profile is not None and self.layers_per_step != "auto" and self.stage_layers != "balanced":
            raise ConfigError("--cost-profile only steers --layers-per-step auto and --stage-layers balanced")
        if self.max_context < 2:
            raise ConfigError(f"--max-context must be at least 2, got {self.max_context}")
        if self.transport not in ("auto", "inproc", "processes"):
            raise ConfigError(f"--transport must be auto, inproc or processes, got {self.transport!r}")
        if self.cluster not in ("local", "ray"):
            raise ConfigError(f"--cluster must be local or ray, got {self.cluster!r}")
        if self.cluster == "ray" and self.transport == "inproc":
            raise ConfigError("--cluster ray runs every stage as a Ray actor; --transport inproc cannot go with it")
        if self.link_delay_ms < 0 or self.link_bandwidth_mbps < 0:
            raise ConfigError("--link-delay-ms and --link-bandwidth-mbps must be >= 0")
        if self.link_encryption and importlib.util.find_spec("cryptography") is None:
            raise ConfigError("--link-encryption needs the `cryptography` package (pip install specpipe[encryption])")
        if self.stage_threads < 0:
            raise ConfigError(f"--stage-threads must be >= 0, got {self.stage_threads}")
        if self.restart_stages < 0:
            raise ConfigError(f"--restart-stages must be >= 0, got {self.restart_stages}")
        if self.stage_timeout_s <= 0:
            raise ConfigError(f"--stage-timeout must be positive, got {self.stage_timeout_s}")
        if self.weight_chunk is not None:
            parse_weight_chunk(self.weight_chunk)
        if self.weight_cache_max is not None:
            parse_cache_max(self.weight_cache_max)
        if self.draft_quantization not in (None, "int8", "int4"):
            raise ConfigError(f"--draft-quantization must be int8 or int4, got {self.draft_quantization!r}")
        if self.mode not in SPECULATIVE_MODES and (self.draft_quantization or self.draft_vocab):
            raise ConfigError(f"--draft-quantization and --draft-vocab have no effect in mode {self.mode}; "
                              f"choose a speculative mode ({', '.join(SPECULATIVE_MODES)})")
        if self.draft_async and self.mode not in SPECULATIVE_MODES:
            raise ConfigError(f"--draft-async has no effect in mode {self.mode}; "
                              f"choose a speculative mode ({', '.join(SPECULATIVE_MODES)})")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ConfigError(f"--draft-vocab must be at least 1, got {self.draft_vocab}")
        if self.mode not in SPECULATIVE_MODES and self.draft:
            raise ConfigError(f"--draft has no effect in mode {self.mode}; choose a speculative mode "
                              f"({', '.join(SPECULATIVE_MODES)})")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.mode in BUDGETED_MODES and self.max_step_rows < self.max_num_seqs:
            raise ConfigError(f"--max-step-rows ({self.max_step_rows}) must be at least --max-num-seqs "
                              f"({self.max_num_seqs}): every running request sends a row in every step")
        if self.max_waiting < 1:  # with no room to wait, every request is refused
            raise ConfigError(f"--max-queue (max_waiting) must be at least 1, got {self.max_waiting}")
        if self.max_waiting_per_client is not None and not 1 <= self.max_waiting_per_client <= self.max_waiting:
            raise ConfigError(f"--max-queue-per-client must be in [1, --max-queue={self.max_waiting}], "
                              f"got {self.max_waiting_per_client}")
        if self.block_size < 1:
            raise ConfigError(f"--block-size must be at least 1, got {self.block_size}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError(f"--kv-memory-fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.kv_memory is not None:
            parse_bytes(self.kv_memory)
        if self.quantization not in (None, "int8", "int4"):
            raise ConfigError(f"--quantization must be int8 or int4, got {self.quantization!r}")

    def torch_dtype(self):
        """The activations' dtype, which float weights are converted to; None (auto on a CPU):
        float32 activations with every weight kept as the checkpoint stores it (GGUF blocks
        stay quantized, bfloat16 stays bfloat16), see model/stage.py."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else None
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}") from None


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MB', '1.5g' or a plain number of bytes."""
    if isinstance(text, int):
        n = text
    else:
        import re

        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"--kv-memory: cannot read {text!r} as a size (e.g. 2GiB, 512MiB, 1e9)")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"--kv-memory must be positive, got {text!r}")
    return n


WEIGHT_CHUNK_MIN, WEIGHT_CHUNK_MAX = 4096, 1 << 30  # --weight-chunk's bounds
WEIGHT_CACHE_MAX_DEFAULT = "50%"  # --weight-cache-max: of what a node's cache holds + its disk's free space


def _option_size(text: str, option: str, example: str) -> int:
    try:
        return parse_bytes(text)
    except (ConfigError, ValueError, OverflowError):
        raise ConfigError(f"{option}: cannot read {text!r} as a positive size (e.g. {example})") from None


def parse_weight_chunk(text: str, option: str = "--weight-chunk") -> int:
    """The streamed weight chunk in bytes, from `text` such as 256KiB; `option` names where it came
    from in the error (the option, or $SPECPIPE_WEIGHT_CHUNK)."""
    n = _option_size(str(text).strip(), option, "256KiB, 8MiB")
    if not WEIGHT_CHUNK_MIN <= n <= WEIGHT_CHUNK_MAX:
        raise ConfigError(f"{option} {text!r}: a chunk must be between 4 KiB and 1 GiB")
    return n


def parse_cache_max(text: str) -> tuple[str, float]:
    """--weight-cache-max: ("bytes", n) for a size (20GiB), ("share", f) for N% of the space a
    node's weight cache could have (what it holds plus the disk's free space)."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ConfigError(f"--weight-cache-max {text!r}: a share must be above 0% and at most 100%")
        return "share", share
    return "bytes", float(_option_size(text, "--weight-cache-max", "20GiB, 500MiB, 50%"))
