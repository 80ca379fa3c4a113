#!/usr/bin/env python3
"""Decode of the new families against llama.cpp on the same GGUF file (issues 59 and 61): DeepSeek-V2-Lite,
GLM-4.5-Air and gpt-oss-20b at their real per-layer shapes, a few layers, random weights.

For each family:
  1. a random-weight Hugging Face checkpoint, named and shaped by transformers' own config and model
     classes (the model is built on the meta device, and each tensor of its state dict is drawn and
     written in the layout `save_pretrained` writes: per-expert tensors for DeepSeek and GLM, checked
     against a tiny `save_pretrained` of the same structure; gpt-oss's experts as MXFP4 blocks and
     scales, as OpenAI ships them). Weights bf16, std 1/sqrt(fan-in); the real hidden size, heads,
     MLA ranks, expert count and width, vocabulary (--vocab to reduce it, said in the results), and
     fewer layers with the real config's first dense layers;
  2. converted by llama.cpp's own convert_hf_to_gguf.py (tests/llama_converter.py: llama-cpp-python's
     sdist) to a bf16 GGUF;
  3. quantized to Q4_K_M by llama.cpp's own quantizer (llama_cpp.llama_model_quantize); for gpt-oss a
     tensor-type override keeps the experts MXFP4 as the converter wrote them (a plain Q4_K_M would
     requantize them), so only its other tensors become Q4_K_M's types; for DeepSeek, llama.cpp's
     loader takes a deepseek2 file for V2-Lite (no query LoRA) only at 26 or 27 layers, so it gets
     `attention.q_lora_rank = 0` as a load-time override (LLAMA_KV_OVERRIDES, below);
  4. greedy decode of --tokens tokens after the same --prompt-tokens prompt by SpecPipe (one stage,
     build_stage's default kernels, `run_rows` a token at a time: bench_vs_llamacpp.greedy_ours) and by
     llama_cpp.Llama (`eval` a token at a time: bench_vs_llamacpp.greedy_theirs), at each of --threads,
     the two engines and the thread counts interleaved in one process, --repeats times (the order
     alternating per repeat, a 0.2 s pause before each run so the other engine's worker threads stop
     spinning). Reported per family and thread count: the median over repeats of each engine's mean
     decode ms per token (the prompt's prefill not counted), llama.cpp's / SpecPipe's (>= 1: SpecPipe
     faster), and whether the greedy tokens agree (and where they first differ, each engine's logit gap
     between its token and the other's: a near-tie when both are small).

    PYTHONPATH=. python benchmarks/families_vs_llamacpp.py [--families deepseek_v2 glm4_moe gpt_oss]
        [--threads 1 2] [--tokens 32] [--prompt-tokens 32] [--repeats 3] [--workdir DIR] [--keep]
        [--layer-times] [--out benchmarks/results/families_vs_llamacpp.json]

Needs llama-cpp-python (built from source, minutes) and ~15 GB of disk in --workdir for GLM's
intermediates (deleted after quantizing unless --keep; the Q4_K_M files are kept and reused).
--layer-times: after the timed runs, SpecPipe's decode time split by module (forward hooks), to say
where its time goes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import specpipe  # noqa: F401  (before torch: sets OpenMP's wait policy, specpipe/cpus.py)
import torch

from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from benchmarks.bench_vs_llamacpp import greedy_ours, greedy_theirs  # noqa: E402
from benchmarks.common import cpu_name, write_json  # noqa: E402

_CHECKED = "SPECPIPE_CHECK_STATE" in os.environ
import conftest  # noqa: E402  (the tiny tokenizer; it turns the engines' state checks on for tests:
if not _CHECKED:  # not wanted here, though nothing timed here reads it)
    os.environ.pop("SPECPIPE_CHECK_STATE", None)

# The released config.json files' per-layer shapes (Hugging Face: deepseek-ai/DeepSeek-V2-Lite,
# zai-org/GLM-4.5-Air, openai/gpt-oss-20b); `layers` replaces num_hidden_layers (the first
# first_k_dense_replace of them dense, as in the real model).
FAMILIES = {
    "deepseek_v2": dict(
        name="DeepSeek-V2-Lite", layers=4, real_layers=27,
        config=dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                    num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                    topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
                    max_position_embeddings=163840,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                     "mscale": 0.707, "mscale_all_dim": 0.707}),
        extra_json=dict(scoring_func="softmax")),
    "glm4_moe": dict(
        name="GLM-4.5-Air", layers=3, real_layers=46,
        config=dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                    num_attention_heads=96, num_key_value_heads=8, head_dim=128, attention_bias=True,
                    use_qk_norm=False, n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                    routed_scaling_factor=1.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                    num_nextn_predict_layers=0,  # its MTP layer: not used to decode by either engine
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}),
        extra_json={}),
    "gpt_oss": dict(
        name="gpt-oss-20b", layers=4, real_layers=24,
        config=dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                    sliding_window=128, swiglu_limit=7.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                    attention_bias=True,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
        extra_json={}),
}
SHARD_BYTES = 1 << 30
GGML_TYPE_MXFP4 = 39


def hf_config(family: str, layers: int, vocab: int | None, tiny: bool = False):
    from transformers import AutoConfig

    kw = dict(FAMILIES[family]["config"], num_hidden_layers=layers)
    if vocab:
        kw["vocab_size"] = vocab
    if family == "gpt_oss":
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if tiny:  # the same structure at toy sizes: only to check the tensor names
        kw.update(vocab_size=300, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                  num_attention_heads=4, num_key_value_heads=2 if family != "deepseek_v2" else 4, head_dim=16,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  n_routed_experts=4, num_local_experts=4)
        if family != "deepseek_v2":
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                kw.pop(k)
        if family != "gpt_oss":
            kw.pop("num_local_experts")
        else:
            kw.pop("n_routed_experts"), kw.pop("moe_intermediate_size")
    eos = conftest.tiny_tokenizer_ids()["<|endoftext|>"]
    kw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    return AutoConfig.for_model(family, **kw)


def meta_model(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def saved_layout(family: str, state: dict) -> list[tuple[str, tuple, str]]:
    """(name, shape, kind) of every tensor as save_pretrained writes them, from the meta model's
    state dict: transformers 5 fuses the experts in memory and writes them per expert (DeepSeek,
    GLM); gpt-oss's fused experts are written as MXFP4 blocks and scales (the released layout)."""
    out = []
    for name, t in state.items():
        shape = tuple(t.shape)
        if family != "gpt_oss" and name.endswith("mlp.experts.gate_up_proj"):  # (E, 2I, H)
            base = name.removesuffix("gate_up_proj")
            e, two_i, h = shape
            for i in range(e):
                out += [(f"{base}{i}.gate_proj.weight", (two_i // 2, h), "weight"),
                        (f"{base}{i}.up_proj.weight", (two_i // 2, h), "weight")]
        elif family != "gpt_oss" and name.endswith("mlp.experts.down_proj"):  # (E, H, I)
            base = name.removesuffix("down_proj")
            e, h, i_ = shape
            out += [(f"{base}{i}.down_proj.weight", (h, i_), "weight") for i in range(e)]
        elif family == "gpt_oss" and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            e, k, r = shape  # x @ W with W (E, in, out): MXFP4 per output row, blocks of 32 along in
            out += [(name + "_blocks", (e, r, k // 32, 16), "mxfp4_blocks"), (name + "_scales", (e, r, k // 32), "mxfp4_scales")]
        else:
            out.append((name, shape, "fp32" if name.endswith("e_score_correction_bias") else "weight"))
    return out


def check_names_against_save_pretrained(family: str, layers: int) -> None:
    """Our per-expert naming equals what transformers' save_pretrained writes, on a tiny model of the
    same structure (DeepSeek and GLM; gpt-oss's MXFP4 names are the released checkpoints')."""
    if family == "gpt_oss":
        return
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg = hf_config(family, layers, None, tiny=True)
    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    ours = {n: s for n, s, _ in saved_layout(family, meta_model(cfg).state_dict())}
    assert ours == saved, (set(ours) ^ set(saved), [(n, ours[n], saved[n]) for n in ours if n in saved and ours[n] != saved[n]])


def draw(name: str, shape: tuple, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "mxfp4_blocks":  # every E2M1 code equally likely (RMS ~2.9 before the scale)
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if kind == "mxfp4_scales":  # E8M0 2^-7 .. 2^-6: weights of std ~1/sqrt(2880)
        return torch.randint(120, 122, shape, generator=gen, dtype=torch.uint8)
    if kind == "fp32":  # GLM's selection bias
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith("sinks"):
        t = torch.randn(shape, generator=gen)
    elif name.endswith("bias"):
        t = 0.02 * torch.randn(shape, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        t = torch.randn(shape, generator=gen)
    else:  # std 1/sqrt(fan-in): activations keep their size through the layers
        t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return t.to(torch.bfloat16)


def write_checkpoint(family: str, layers: int, vocab: int | None, hf_dir: Path, seed: int = 0) -> None:
    from llama_converter import NEEDED_SPECIAL_TOKENS
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer

    check_names_against_save_pretrained(family, layers)
    cfg = hf_config(family, layers, vocab)
    meta = meta_model(cfg)
    layout, arch = saved_layout(family, meta.state_dict()), type(meta).__name__
    del meta
    hf_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards, cur, size = [], {}, 0
    for name, shape, kind in layout:
        cur[name] = draw(name, shape, kind, gen).contiguous()
        size += cur[name].numel() * cur[name].element_size()
        if size >= SHARD_BYTES:
            shards.append(cur)
            save_file(cur, str(hf_dir / f"part{len(shards)}.tmp"), metadata={"format": "pt"})
            cur, size = {}, 0
    if cur:
        shards.append(cur)
        save_file(cur, str(hf_dir / f"part{len(shards)}.tmp"), metadata={"format": "pt"})
    n, weight_map = len(shards), {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        (hf_dir / f"part{i}.tmp").rename(hf_dir / fname)
        weight_map.update({k: fname for k in shard})
    del shards, cur
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.save_pretrained(hf_dir)
    data = json.loads((hf_dir / "config.json").read_text())
    data.update(FAMILIES[family]["extra_json"], architectures=[arch])
    if family == "gpt_oss":
        data["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (hf_dir / "config.json").write_text(json.dumps(data, indent=2))
    conftest.write_tiny_tokenizer(hf_dir)  # 300 real tokens; the converter pads the vocabulary to vocab_size
    missing = NEEDED_SPECIAL_TOKENS.get(family, ())
    if missing:  # GLM's converter looks these up by name (added here rather than in a copy of the files)
        tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing
                                if tok.token_to_id(t) is None])
        tok.save(str(hf_dir / "tokenizer.json"))


# llama.cpp reads a deepseek2 file as V2-Lite-like (a plain q_proj, no query LoRA) only when it has
# 26 or 27 layers (src/models/deepseek2.cpp: is_lite); any other layer count must name
# attention.q_lora_rank, which the converter does not write for V2-Lite (q_lora_rank null). So
# llama.cpp gets this key as a load-time override (llama-quantize / llama-cli's --override-kv:
# with 0, its loader takes the same plain-q_proj path as for the 27-layer file), and the key
# the quantizer writes from the override is removed again with gguf-py's gguf_new_metadata.py:
# the file both engines read is the converter's metadata with the quantizer's tensors.
LLAMA_KV_OVERRIDES = {"deepseek_v2": {"deepseek2.attention.q_lora_rank": 0}}


def quantize(src: Path, dst: Path, family: str, threads: int) -> None:
    import subprocess

    import llama_cpp
    from llama_converter import converter_dir

    p = llama_cpp.llama_model_quantize_default_params()
    p.nthread = threads
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    if family == "gpt_oss":  # keep the converter's MXFP4 experts (copied as they are: same type)
        overrides = (llama_cpp.llama_model_tensor_override * 2)()
        overrides[0].pattern, overrides[0].type = b"ffn_(gate|up|down)_exps", GGML_TYPE_MXFP4
        overrides[1].pattern = None
        p.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    kv = LLAMA_KV_OVERRIDES.get(family, {})
    if kv:
        kvo = (llama_cpp.llama_model_kv_override * (len(kv) + 1))()
        for o, (key, val) in zip(kvo, kv.items()):
            o.tag, o.key, o.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, key.encode(), val
        kvo[len(kv)].key = b""
        p.kv_overrides = ctypes.cast(kvo, ctypes.POINTER(llama_cpp.llama_model_kv_override))
    out = dst.with_suffix(".kv") if kv else dst
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(p))
    if rc != 0 or not out.is_file():
        raise RuntimeError(f"llama_model_quantize failed ({rc}) on {src}")
    if kv:
        root = converter_dir() / "gguf-py"
        cmd = [sys.executable, str(root / "gguf" / "scripts" / "gguf_new_metadata.py"), str(out), str(dst), "--force"]
        for key in kv:
            cmd += ["--remove-metadata", key]
        run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(root)))
        if run.returncode != 0 or not dst.is_file():
            raise RuntimeError(f"gguf_new_metadata.py failed: {run.stderr[-2000:]}")
        out.unlink()


def tensor_types(path: Path) -> dict:
    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors))


def make_gguf(family: str, args) -> Path:
    from llama_converter import convert

    layers = args.layers.get(family, FAMILIES[family]["layers"])
    tag = f"{family}-L{layers}" + (f"-V{args.vocab}" if args.vocab else "")
    out = args.workdir / f"{tag}-Q4_K_M.gguf"
    if out.is_file():
        return out
    hf_dir, bf16 = args.workdir / f"{tag}-hf", args.workdir / f"{tag}-bf16.gguf"
    t0 = time.time()
    if not bf16.is_file():
        if not (hf_dir / "tokenizer.json").is_file():  # written last
            shutil.rmtree(hf_dir, ignore_errors=True)
            write_checkpoint(family, layers, args.vocab, hf_dir)
        print(f"# {family}: checkpoint written ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        convert(hf_dir, bf16.with_suffix(".tmp"), outtype="bf16")
        bf16.with_suffix(".tmp").rename(bf16)
        print(f"# {family}: converted ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        if not args.keep:
            shutil.rmtree(hf_dir)
    quantize(bf16, out.with_suffix(".tmp"), family, max(args.threads))
    out.with_suffix(".tmp").rename(out)
    print(f"# {family}: quantized ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    if not args.keep:
        bf16.unlink()
    return out


def set_threads(llm, n: int) -> None:
    import llama_cpp

    torch.set_num_threads(n)
    llama_cpp.llama_set_n_threads(llm._ctx.ctx, n, n)


def first_difference(a, a_rows, b, b_rows) -> dict:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    out = {"agree": same, "of": len(a)}
    if same < len(a):
        out["ours_gap"] = round(float(a_rows[same][a[same]] - a_rows[same][b[same]]), 4)
        out["llamacpp_gap"] = round(float(b_rows[same][b[same]] - b_rows[same][a[same]]), 4)
    return out


def layer_times(model, prompt: list[int], steps: int, threads: int) -> dict:
    """SpecPipe's decode time by module: forward hooks on the stage's embedding, final norm and LM head,
    each layer, its children (attention, MLP or MoE, norms) and the MoE's router, shared expert and
    routed experts (summed over the experts called), ms per decode token."""
    torch.set_num_threads(threads)
    spent: Counter = Counter()
    starts: dict = {}
    hooks = []
    mods = [(n, m) for n, m in model.named_children() if n != "layers"]
    for i, layer in model.layers.items():
        mods.append((f"layers.{i}", layer))  # a fused (one native call) layer calls none of its children
        for n, m in layer.named_children():
            mods.append((f"layers.{i}.{n}", m))
            if n == "mlp" and hasattr(m, "experts"):
                mods += [(f"layers.{i}.mlp.{c}", getattr(m, c)) for c in ("gate", "shared_experts")
                         if getattr(m, c, None) is not None]
                mods += [(f"layers.{i}.mlp.experts", e) for e in m.experts]  # summed over the experts called
    on = [False]  # hooks count only decode rows, not the prompt's prefill

    def pre(m, a, n):
        starts[n] = time.perf_counter()

    def post(m, a, o, n):
        if on[0]:
            spent[n] += time.perf_counter() - starts[n]

    for name, mod in mods:
        hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: pre(m, a, n)))
        hooks.append(mod.register_forward_hook(lambda m, a, o, n=name: post(m, a, o, n)))
    try:
        greedy_ours(model, prompt, 2)  # warm-up
        n = len(prompt)
        kv = model.make_kv_cache(n + steps + 1)
        logits = run_rows(model, kv, torch.tensor(prompt), list(range(n)), list(range(n)), list(range(n)),
                          np.tril(np.ones((n, n), dtype=bool)), [n - 1])[-1]
        on[0] = True
        t0 = time.perf_counter()
        for i in range(steps):
            pos = n + i
            logits = run_rows(model, kv, torch.tensor([int(logits.argmax())]), [pos], [pos], list(range(pos + 1)),
                              None)[-1]
        total = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    by = {k: round(v / steps * 1e3, 3) for k, v in sorted(spent.items())}
    return {"decode_ms_per_token_with_hooks": round(total / steps * 1e3, 2), "by_module": by}


def bench_family(family: str, path: Path, args) -> dict:
    from llama_cpp import Llama

    ckpt = open_checkpoint(str(path))
    model = build_stage(ckpt, StageSpec.whole(ckpt.config))
    kernels = sorted({m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), str)})
    llm = Llama(model_path=str(path), n_ctx=args.prompt_tokens + args.tokens + 16, n_batch=512,
                kv_overrides=LLAMA_KV_OVERRIDES.get(family),
                n_threads=max(args.threads), n_threads_batch=max(args.threads), logits_all=False, verbose=False)
    prompt = [int(i) for i in np.random.default_rng(1).integers(0, 256, args.prompt_tokens)]  # byte tokens
    engines = {"specpipe": lambda: greedy_ours(model, prompt, args.tokens),
               "llama.cpp": lambda: greedy_theirs(llm, prompt, args.tokens)}
    ms = {(e, t): [] for e in engines for t in args.threads}
    tokens, rows = {}, {}
    for t in args.threads:  # warm-up: a short run of each at each thread count
        set_threads(llm, t)
        for e in engines:
            greedy_ours(model, prompt, 2) if e == "specpipe" else greedy_theirs(llm, prompt, 2)
    for rep in range(args.repeats):
        order_t = args.threads if rep % 2 == 0 else args.threads[::-1]
        for t in order_t:
            set_threads(llm, t)
            order_e = list(engines) if (rep + order_t.index(t)) % 2 == 0 else list(engines)[::-1]
            for e in order_e:
                time.sleep(0.2)
                toks, logit_rows, times = engines[e]()
                ms[(e, t)].append(sum(times) / len(times) * 1e3)
                print(f"# {family} rep {rep} t={t} {e}: {ms[(e, t)][-1]:.2f} ms/token", file=sys.stderr, flush=True)
                if (e, t) not in tokens:
                    tokens[(e, t)] = toks
                    rows[(e, t)] = [r.float().numpy() if isinstance(r, torch.Tensor) else r for r in logit_rows]
    records = []
    for t in args.threads:
        ours, theirs = statistics.median(ms[("specpipe", t)]), statistics.median(ms[("llama.cpp", t)])
        records.append({"threads": t, "specpipe_ms_per_token": round(ours, 2), "llamacpp_ms_per_token": round(theirs, 2),
                        "speed_vs_llamacpp": round(theirs / ours, 3),
                        "specpipe_runs_ms": [round(x, 2) for x in ms[("specpipe", t)]],
                        "llamacpp_runs_ms": [round(x, 2) for x in ms[("llama.cpp", t)]],
                        "tokens": first_difference(tokens[("specpipe", t)], rows[("specpipe", t)],
                                                   tokens[("llama.cpp", t)], rows[("llama.cpp", t)])})
    t0, t1 = args.threads[0], args.threads[-1]
    result = {"family": family, "model": FAMILIES[family]["name"], "file": path.name,
              "file_mb": round(path.stat().st_size / 2**20, 1), "tensor_types": tensor_types(path),
              "layers": ckpt.config.num_layers, "real_layers": FAMILIES[family]["real_layers"],
              "vocab": ckpt.config.vocab_size, "specpipe_kernels": kernels, "records": records,
              "specpipe_tokens": tokens[("specpipe", t0)], "llamacpp_tokens": tokens[("llama.cpp", t0)],
              "specpipe_same_tokens_across_threads": tokens[("specpipe", t0)] == tokens[("specpipe", t1)],
              "llamacpp_same_tokens_across_threads": tokens[("llama.cpp", t0)] == tokens[("llama.cpp", t1)]}
    if args.layer_times:
        result["specpipe_layer_times_1_thread"] = layer_times(model, prompt, min(args.tokens, 16), args.threads[0])
    del llm, model, ckpt
    gc.collect()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", default="", help="family=N,... (default: DeepSeek 4, GLM 3, gpt-oss 4)")
    ap.add_argument("--vocab", type=int, default=None, help="reduce every family's vocabulary to this (default: the real one)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "families_vs_llamacpp")
    ap.add_argument("--keep", action="store_true", help="keep the Hugging Face directory and the bf16 GGUF")
    ap.add_argument("--layer-times", action="store_true", help="also SpecPipe's decode time by module")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.layers = {k: int(v) for k, v in (kv.split("=") for kv in args.layers.split(",") if kv)}
    args.workdir.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "cpu": cpu_name(), "cpus": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__,
            "threads": args.threads, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats, "load_avg_start": os.getloadavg()}
    try:
        import llama_cpp

        meta["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        print("llama-cpp-python is not installed", file=sys.stderr)
        return 1
    results = []
    for family in args.families:
        path = make_gguf(family, args)
        results.append(bench_family(family, path, args))
        r = results[-1]
        for rec in r["records"]:
            print(f"{r['model']} ({r['layers']} layers), {rec['threads']} thr: SpecPipe {rec['specpipe_ms_per_token']} ms, "
                  f"llama.cpp {rec['llamacpp_ms_per_token']} ms, x{rec['speed_vs_llamacpp']}, tokens {rec['tokens']}",
                  flush=True)
        if args.out:  # after each family, so a late failure keeps the earlier ones
            meta["load_avg_end"] = os.getloadavg()
            write_json(args.out, {"meta": meta, "results": results})
    print("\n| family | threads | SpecPipe ms/token | llama.cpp ms/token | speed vs llama.cpp | greedy tokens agree |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for rec in r["records"]:
            tk = rec["tokens"]
            agree = "all %d" % tk["of"] if tk["agree"] == tk["of"] else \
                f"first {tk['agree']} of {tk['of']} (gaps {tk['ours_gap']} / {tk['llamacpp_gap']})"
            print(f"| {r['model']} ({r['layers']} of {r['real_layers']} layers) | {rec['threads']} | "
                  f"{rec['specpipe_ms_per_token']} | {rec['llamacpp_ms_per_token']} | {rec['speed_vs_llamacpp']} | {agree} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
