"""gpt-oss (`gpt_oss`) against transformers' own classes, and in every mode.

Tiny random checkpoints written by transformers' GptOssForCausalLM: 4 layers alternating
sliding-window (6 positions, shorter than the prompts) and full attention, attention sinks drawn
non-zero after init, biases on q/k/v/o, router and experts non-zero, 4 experts top-2 with the
clamped SwiGLU at a limit low enough to clamp, YaRN RoPE. Two layouts of the same model:
float experts as save_pretrained writes them, and the experts as OpenAI ships them, MXFP4 blocks
and scales (quantized here by a plain reference quantizer, `quantize_mxfp4`), loaded packed and
compared with transformers running on its own dequantization of those bytes
(integrations/mxfp4.py convert_moe_packed_tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY_SHAPE, tiny_tokenizer_ids, write_tiny_tokenizer
from specpipe.config import StageSpec
from specpipe.kernels.qlinear import QuantLinear
from specpipe.loader import open_checkpoint
from specpipe.loader.hf_gpt_oss import ggml_mxfp4_rows
from specpipe.model.stage import build_stage
from specpipe.request import Request
from test_model_vs_hf import greedy_ours, hf_logits, max_diff, prefill_then_decode, random_tokens, whole_model
from specpipe.sampling import SamplingParams
from test_moe_families_lossless import (PROMPT, assert_every_mode_equals_pp, assert_restart_equals_pp,
                                        assert_structured_equal_in_every_mode)

transformers = pytest.importorskip("transformers")

RTOL = 2e-5  # of the logits' largest magnitude, as the other families
# The modes' runs: 8 tokens a request (the other MoE families' 12, fewer to keep CI's time down)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=8)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def gpt_oss_config(swiglu_limit: float = 3.0):
    from transformers import GptOssConfig

    eos = tiny_tokenizer_ids()["<|endoftext|>"]
    shape = dict(TINY_SHAPE, intermediate_size=32)
    return GptOssConfig(**shape, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                        swiglu_limit=swiglu_limit, bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
                        tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 64})


def make_model(seed: int, swiglu_limit: float = 3.0):
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM._from_config(gpt_oss_config(swiglu_limit), attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):  # transformers draws them small: make them matter
                p.copy_(1.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.weight"):  # a router far from ties
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.eval()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., R, K) float -> transformers' MXFP4: blocks (..., R, K/32, 16) uint8 (weights 2i and
    2i + 1 in the low and high nibble of byte i), scales (..., R, K/32) uint8 (E8M0, bias 127).
    Each block's scale puts its largest magnitude in [4, 8); codes are the nearest E2M1 value."""
    b = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).float()
    amax = b.abs().amax(-1).clamp(min=2.0 ** -100)
    e = torch.floor(torch.log2(amax)) - 2  # (..., R, K/32)
    codes = (b / torch.exp2(e)[..., None]).unsqueeze(-1).sub(E2M1).abs().argmin(-1).to(torch.uint8)  # (..., 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (e + 127).to(torch.uint8)


def write_dir(directory: Path, seed: int, mxfp4: bool, swiglu_limit: float = 3.0):
    """The checkpoint directory; returns (directory, transformers' model of the same values)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = make_model(seed, swiglu_limit)
    directory.mkdir(parents=True, exist_ok=True)
    if not mxfp4:
        model.save_pretrained(directory)
    else:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        for i in range(model.config.num_hidden_layers):
            experts = model.model.layers[i].mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                w = state.pop(f"model.layers.{i}.mlp.experts.{proj}")  # (E, in, out): x @ W
                blocks, scales = quantize_mxfp4(w.transpose(1, 2))  # per output row, blocks along in
                state[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks.contiguous()
                state[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales.contiguous()
                with torch.no_grad():  # the reference runs on transformers' dequantization of these bytes
                    getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(directory)
        cfg = json.loads((directory / "config.json").read_text())
        cfg["architectures"] = ["GptOssForCausalLM"]  # (model.save_pretrained's, which this replaces)
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tiny_tokenizer(directory)
    return directory, model


_WRITTEN: dict[str, tuple[Path, object]] = {}


def layout(kind: str, tmp_path_factory):
    if kind not in _WRITTEN:
        _WRITTEN[kind] = write_dir(tmp_path_factory.mktemp(f"gpt_oss_{kind}"), seed=61, mxfp4=kind == "mxfp4")
    return _WRITTEN[kind]


@pytest.fixture(scope="module", params=["float", "mxfp4"])
def checkpoint(request, tmp_path_factory):
    return layout(request.param, tmp_path_factory)


def test_logits_match_transformers(checkpoint):
    """Float experts, and MXFP4 experts on the `dequant` kernel (exact weights, float activations):
    within float rounding of transformers. MXFP4 on the native kernel quantizes activations per 32
    values to 8 bits (as llama.cpp's MXFP4 dot product does: docs/native_kernels.md), so there only
    the argmax must agree and the logits be near."""
    path, ref = checkpoint
    mxfp4 = "mxfp4" in path.name
    ckpt = open_checkpoint(path)
    ours = build_stage(ckpt, StageSpec.whole(ckpt.config), kernel="dequant" if mxfp4 else None)
    cfg = ours.cfg
    assert cfg.arch == "gpt_oss" and cfg.attention_sinks and cfg.o_proj_bias and cfg.attention_bias
    assert cfg.sliding_window == 6 and cfg.sliding_layers == (0, 2)
    assert cfg.moe.scoring == "topk_softmax" and cfg.moe.swiglu_limit == 3.0
    tokens = random_tokens(30, cfg.vocab_size, seed=7)
    got = prefill_then_decode([ours], tokens, 20)  # prefill past the window, then cached decode
    want = hf_logits(ref, tokens)
    assert want.abs().max() > 1.0 and want.std() > 0.3, "reference logits degenerate: test too weak"
    assert max_diff(got, want) < RTOL * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if mxfp4:
        native = prefill_then_decode([whole_model(path)], tokens, 20)
        assert torch.equal(native.argmax(-1), want.argmax(-1))
        assert max_diff(native, want) < 0.1 * want.abs().max()


def test_greedy_matches_generate(checkpoint):
    path, ref = checkpoint
    prompt = random_tokens(10, 300, seed=8)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    assert greedy_ours(whole_model(path), prompt, 32, set()) == want
    assert len(set(want)) > 4


def test_mxfp4_experts_stay_packed(checkpoint):
    path, _ = checkpoint
    stage = whole_model(path)
    experts = [m for n, m in stage.named_modules() if ".experts." in n and n.endswith(("_proj", "gate_up"))]
    quantized = [m for m in experts if isinstance(m, QuantLinear)]
    if "mxfp4" in path.name:
        assert quantized and all(m.qtype.name == "MXFP4" for m in quantized)
        assert not [n for n, p in stage.named_parameters() if ".experts." in n and n.endswith("weight")]
    else:
        assert not quantized


def test_a_stage_reads_only_its_layers(checkpoint, tmp_path):
    """A copy holding only the byte ranges stage_ranges names for the last two layers (the rest
    of each file a hole) builds that stage with the same weights; those ranges leave out the
    first two layers' experts. On the MXFP4 layout the experts stay packed, and the float32
    kernel (what a GPU stage uses) dequantizes them at load to what `dequant` computes with."""
    path, _ = checkpoint
    ckpt = open_checkpoint(path)
    spec = StageSpec(2, 4, False, True)
    need = ckpt.stage_ranges(spec)
    copy = tmp_path / "copy"
    copy.mkdir()
    for rel, size in need.files:
        with open(copy / rel, "wb") as f:
            f.truncate(size)
    for rel, offset, length in need.ranges:
        with open(path / rel, "rb") as src, open(copy / rel, "r+b") as dst:
            src.seek(offset)
            dst.seek(offset)
            dst.write(src.read(length))
    shards = [t for rel, t in need.files if rel.endswith(".safetensors")]
    assert need.total < 0.8 * sum(shards)  # the embedding and layers 0-1 are left out
    ours, theirs = build_stage(ckpt, spec), build_stage(open_checkpoint(copy), spec)
    weights = lambda m: [t for _, t in m.named_parameters()] + [  # noqa: E731
        t for q in m.modules() if isinstance(q, QuantLinear) for t in q.weight_tensors()]
    assert len(weights(ours)) == len(weights(theirs)) > 0
    assert all(torch.equal(a, b) for a, b in zip(weights(ours), weights(theirs)))
    if "mxfp4" in path.name:
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
        unpacked = build_stage(ckpt, spec, kernel="float32").layers["3"].mlp.experts[1]
        packed = build_stage(ckpt, spec, kernel="dequant").layers["3"].mlp.experts[1]
        assert max_diff(unpacked(x), packed(x)) < 1e-5


def test_the_features_matter(checkpoint):
    """Guards for the comparison above: zeroing the sinks, or widening the window, moves the logits."""
    path, _ = checkpoint
    tokens = random_tokens(24, 300, seed=3)
    want = prefill_then_decode([whole_model(path)], tokens, 24)
    stage = whole_model(path)
    with torch.no_grad():
        for layer in stage.layers.values():
            layer.self_attn.sinks.zero_()
    assert max_diff(prefill_then_decode([stage], tokens, 24), want) > 1e-3
    ckpt = open_checkpoint(path)
    object.__setattr__(ckpt.config, "sliding_layers", ())
    wide = build_stage(ckpt, StageSpec.whole(ckpt.config))
    assert max_diff(prefill_then_decode([wide], tokens, 24), want) > 1e-3


def test_mxfp4_repack_equals_reference_dequantizers():
    """HF's MXFP4 bytes -> GGML MXFP4 rows: gguf's reference dequantizer of the rows equals
    transformers' dequantizer of the bytes."""
    import gguf
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 8, 96, generator=torch.Generator().manual_seed(5)) * 0.3
    blocks, scales = quantize_mxfp4(w)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # (E, R, K)
    for e in range(3):
        rows = ggml_mxfp4_rows(blocks[e], scales[e])
        got = torch.from_numpy(gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType.MXFP4))
        assert torch.equal(got.reshape(8, 96), want[e])
    assert (want - w).abs().max() < 0.25 * w.abs().max()  # the quantizer is a quantizer


def test_attention_sinks_native_equals_torch_and_reference():
    """The native kernel's sinks (attention.c) and the torch path's against softmax over the scores
    with the sink appended, as transformers' eager_attention_forward computes it; and a row's
    result is the same alone as among other rows (the lossless property)."""
    from specpipe.kernels import native
    from specpipe.model.attention import attend_torch

    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(7, 4, 16, generator=g), torch.randn(11, 2, 16, generator=g), torch.randn(11, 2, 16, generator=g)
    sinks = 2.0 * torch.randn(4, generator=g)
    mask = torch.rand(7, 11, generator=g) > 0.3
    mask[:, 0] = True
    scores = torch.einsum("thd,chd->htc", q, k.repeat_interleave(2, 1)) * 0.25
    scores = torch.cat([scores.masked_fill(~mask, float("-inf")), sinks.view(4, 1, 1).expand(4, 7, 1)], -1)
    want = torch.einsum("htc,chd->thd", torch.softmax(scores, -1)[..., :-1], v.repeat_interleave(2, 1))
    assert max_diff(attend_torch(q, k, v, mask, 0.25, sinks), want) < 1e-5
    if native.available():
        got = native.attention(q, k, v, mask, 0.25, sinks=sinks)
        assert max_diff(got, want) < 1e-5
        assert torch.equal(native.attention(q[3:4], k, v, mask[3:4], 0.25, sinks=sinks), got[3:4])
        assert max_diff(native.attention(q, k, v, mask, 0.25), want) > 1e-2  # the sinks matter


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_mode_equals_pp(tmp_path_factory, sampling):
    """On the MXFP4 layout (the float one differs only at load): greedy at S = 1 and 3, seeded at
    S = 2, with a same-family draft merged with n-grams and prefix caching (as the other MoE
    families: test_moe_families_lossless.serve). The 4 layers split 2+1+1 at S = 3: a sliding and
    a full layer, then one of each kind alone."""
    path, _ = layout("mxfp4", tmp_path_factory)
    assert_every_mode_equals_pp(open_checkpoint(path), sampling, "gpt-oss mxfp4")


def test_every_mode_equals_pp_across_a_stage_restart(tmp_path_factory, monkeypatch):
    """The stages die in the middle of a request and are started again (pp at S = 2, specpipe at
    S = 3, specpipe-db at S = 2; seeded, prefix caching on): the sliding layers' and the full
    layers' KV recomputed from prompt + output so far give an undisturbed pp's tokens
    (test_moe_families_lossless.assert_restart_equals_pp)."""
    path, _ = layout("mxfp4", tmp_path_factory)
    assert_restart_equals_pp(open_checkpoint(path), SAMPLED, "gpt-oss mxfp4", monkeypatch)


def test_structured_request_equal_in_every_mode(tmp_path_factory):
    """A JSON-schema request (the tiny tokenizer, llguidance's masks) in every mode at S = 2:
    constrained pp's tokens, valid JSON of the schema (test_moe_families_lossless)."""
    path, _ = layout("mxfp4", tmp_path_factory)
    assert_structured_equal_in_every_mode(open_checkpoint(path), path, "gpt-oss mxfp4")


@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_gguf_from_llama_cpp_converter_gives_the_same_tokens(tmp_path_factory, kind):
    """The checkpoint converted by llama.cpp's own converter (tests/llama_converter.py): MXFP4 experts
    repacked by it stay MXFP4 in the file, float ones are written as float32. llama.cpp fixes the
    SwiGLU limit at 7 (the file has no key for it), so this checkpoint keeps transformers' default.
    Greedy tokens equal the Hugging Face directory's, whole and in two stages reading only their bytes."""
    from llama_converter import convert

    d = tmp_path_factory.mktemp(f"gpt_oss_gguf_{kind}")
    path, ref = write_dir(d / "hf", seed=62, mxfp4=kind == "mxfp4", swiglu_limit=7.0)
    gguf_path = convert(path, d / "model.gguf", outtype="f32")
    ckpt, hf = open_checkpoint(gguf_path), open_checkpoint(path)
    cfg = ckpt.config
    assert cfg.arch == "gpt_oss" and cfg.attention_sinks and cfg.o_proj_bias and cfg.sliding_layers == (0, 2)
    assert (cfg.moe, cfg.rope_scaling, cfg.sliding_window) == (hf.config.moe, hf.config.rope_scaling,
                                                                 hf.config.sliding_window)
    if kind == "mxfp4":
        assert ckpt.stored_type("layers.1.mlp.experts.2.up_proj.weight").name == "MXFP4"
        assert torch.equal(ckpt.load_packed("layers.1.mlp.experts.2.up_proj.weight")[1],
                           hf.load_packed("layers.1.mlp.experts.2.up_proj.weight")[1])
    for name in ("layers.1.self_attn.sinks", "layers.1.mlp.experts.3.gate_proj.bias", "layers.0.mlp.gate.bias",
                 "layers.2.mlp.experts.1.down_proj.weight"):
        assert torch.equal(ckpt.load(name), hf.load(name)), name
    prompt = random_tokens(10, 300, seed=8)
    want = greedy_ours(whole_model(path), prompt, 16, set())
    assert greedy_ours(whole_model(gguf_path), prompt, 16, set()) == want
    stages = [build_stage(ckpt, s) for s in (StageSpec(0, 2, True, False), StageSpec(2, 4, False, True))]
    tokens = prompt + want
    assert torch.equal(prefill_then_decode(stages, tokens, 12).argmax(-1)[10:-1],
                       torch.tensor(want[1:]))


def test_window_pool_and_auto_equal_pp(tmp_path_factory):
    """The sliding layers in the serving modes' window KV pool (kv/slot_table.py: a pool far smaller
    than the request's context, each stage holding one sliding and one full layer at S = 2) in pp-cb
    and specpipe-db, and `--layers-per-step auto` in specpipe (on the one pool: auto's deeper trees
    reserve more than such a small window pool holds): pp's tokens, every window block back at the end."""
    from specpipe.engine.core import EngineCore
    from specpipe.loader.partition import partition_layers
    from specpipe.sched.block_manager import window_need
    from specpipe.spec_decode.sources import NgramSource
    from specpipe.worker.local_pipeline import LocalPipeline
    from specpipe.worker.stage_worker import StageWorker

    path, _ = layout("mxfp4", tmp_path_factory)
    ckpt = open_checkpoint(path)
    window, sampling = ckpt.config.sliding_window, SamplingParams(temperature=0.0, max_tokens=32)

    def decode(mode, num_stages, window_blocks=0, layers=1):
        workers = [StageWorker(build_stage(ckpt, s), 64, 4, window_blocks=window_blocks)
                   for s in partition_layers(ckpt.config.num_layers, num_stages)]
        core = EngineCore(LocalPipeline(workers), mode, NgramSource() if mode != "pp-cb" else None, width=4,
                          layers=layers, kv_blocks=64, block_size=4, max_num_seqs=1, step_rows=4,
                          window_pool=(window, window_blocks) if window_blocks else None)
        req = Request(0, PROMPT + PROMPT[:4], sampling, frozenset())
        core.run([req])
        assert all(w.slots.window is None or w.slots.window.blocks_in_use() == 0 for w in workers)
        return req

    reference = decode("pp", 1).output_ids
    context = len(PROMPT) + 4 + sampling.max_tokens
    assert decode("specpipe", 2, layers="auto").output_ids == reference  # auto's deep trees: the plain pool
    for mode, layers in (("pp-cb", 1), ("specpipe-db", 1)):
        reserve = EngineCore(LocalPipeline([StageWorker(build_stage(ckpt, s), 64, 4)
                                            for s in partition_layers(ckpt.config.num_layers, 2)]),
                             mode, NgramSource(), width=4, layers=layers).spec_reserve()
        blocks = -(-window_need(context + reserve, window, reserve, 2, 4) // 4) + 1
        assert blocks * 4 < context
        req = decode(mode, 2, blocks, layers)
        assert req.output_ids == reference, (mode, layers)
        assert req.stats.preemptions == 0


def test_the_released_20b_config_reads_as_transformers_builds_it():
    """gpt-oss-20b's config.json as OpenAI publishes it (legacy rope_scaling with truncate false,
    an MXFP4 quantization_config): the options, and YaRN's frequencies and cos/sin factor equal
    transformers' own (ROPE_INIT_FUNCTIONS["yarn"] on GptOssConfig) at its real factor 32."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specpipe.loader.hf_config import model_config_from_hf
    from specpipe.model.rope import rope_attention_factor, rope_inv_freq

    raw = dict(architectures=["GptOssForCausalLM"], attention_bias=True, eos_token_id=200002, experts_per_token=4,
               head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096, intermediate_size=2880,
               layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
               model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24,
               num_key_value_heads=8, num_local_experts=32, pad_token_id=199999, rms_norm_eps=1e-05,
               quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                               "model.embed_tokens", "lm_head"],
                                    "quant_method": "mxfp4"},
               rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings":
                             4096, "rope_type": "yarn", "truncate": False},
               rope_theta=150000, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088)
    cfg = model_config_from_hf(raw)
    assert (cfg.arch, cfg.num_layers, cfg.head_dim, cfg.num_kv_heads, cfg.sliding_window) == ("gpt_oss", 24, 64, 8, 128)
    assert cfg.sliding_layers == tuple(range(0, 24, 2)) and cfg.attention_sinks and cfg.o_proj_bias
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.swiglu_limit) == (32, 4, 2880, 7.0)
    assert cfg.rope_scaling.truncate is False
    ref = GptOssConfig(**{k: v for k, v in raw.items() if k not in ("quantization_config", "rope_scaling")},
                       rope_parameters=dict(raw["rope_scaling"], rope_theta=150000.0))
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](ref, "cpu")
    assert torch.allclose(rope_inv_freq(cfg), inv.float(), rtol=1e-6, atol=0)
    assert abs(rope_attention_factor(cfg) - factor) < 1e-9
