"""Build one pipeline stage's model from a checkpoint, loading only that stage's tensors.

Weights stay in the form the checkpoint stores them: GGUF quantized blocks become QuantLinear /
QuantEmbedding modules holding the packed rows (kernels/qlinear.py), float weights stay in their
stored float type (bf16 stays bf16) unless a dtype is asked for. `quantization` ("int8" / "int4")
turns float weights into Q8_0 / Q4_0 blocks at load, so they go through the same QuantLinear;
with `requantize` (a draft model's --draft-quantization) quantized weights stored in a wider type
are requantized to it as well.
Tensors are loaded one at a time, so the peak is the stage plus one tensor in float32.
"""

from __future__ import annotations

import os

from typing import Optional

import gguf
import numpy as np
import torch
import torch.nn as nn

from specpipe.config import StageSpec
from specpipe.kernels import native
from specpipe.kernels.ggml_types import FLOAT_TYPES
from specpipe.kernels.qlinear import QuantEmbedding, QuantLinear, StackedLinear
from specpipe.kernels.registry import choose_kernel, get_kernel, kernels
from specpipe.loader.checkpoint import Checkpoint, CheckpointError, check_attention_group
from specpipe.loader.weight_memory import weight_arena
from specpipe.model.fused import fuse_layers
from specpipe.model.llama import Attention, LlamaStage
from specpipe.model.mla import LatentAttention
from specpipe.model.moe import MLP
from specpipe.model.routing import FLOAT32_PARAMS

Q = gguf.GGMLQuantizationType
QUANTIZATIONS = {"int8": Q.Q8_0, "int4": Q.Q4_0}
# kv_b_proj is not one: latent attention reads its weight as two per-head matrices (model/mla.py)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")


def checkpoint_name(param_name: str, ckpt_names: set[str]) -> str:
    # A tied LM head has no tensor of its own: it is the embedding matrix.
    if param_name == "lm_head.weight" and param_name not in ckpt_names:
        return "embed_tokens.weight"
    return param_name


def bits_per_weight(qtype) -> float:
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return 8 * nbytes / values


def _packed(ckpt: Checkpoint, src: str, quantization: Optional[str], kernel: Optional[str],
            requantize: bool = False):
    """(qtype, packed rows) when `src` is to stay (or become) quantized, else None. requantize:
    a quantized tensor whose type takes more bits per weight than `quantization`'s is
    requantized (from its dequantized values) too; one that takes as few or fewer is kept."""
    if kernel == "float32":
        return None  # the old way: dequantized to float32 at load (for comparisons and benchmarks)
    qtype = QUANTIZATIONS[quantization] if quantization is not None else None
    found = ckpt.load_packed(src)
    if found is not None and found[0] not in FLOAT_TYPES:
        if not (requantize and bits_per_weight(found[0]) > bits_per_weight(qtype)):
            return found[0], found[1]
    if qtype is None or len(ckpt.shape(src)) != 2:
        return None
    w = ckpt.load(src).numpy()  # one tensor in float32 at a time
    return qtype, torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, qtype)))


def default_kernel(device: torch.device | str, quantization: Optional[str]) -> Optional[str]:
    """SPECPIPE_KERNEL when set; else None, the registry's choice per type, which keeps the
    file's blocks packed on a CPU: the native kernel where it is built, otherwise the portable
    `dequant` kernel (a tile of rows dequantized per call: the file's size in memory, slower than
    native; docs/quantized_weights.md). On a GPU, "float32": GGUF weights dequantized at load, as
    before. --quantization always keeps its blocks: it was asked for to save memory."""
    if os.environ.get("SPECPIPE_KERNEL"):
        return os.environ["SPECPIPE_KERNEL"]
    if quantization is not None or torch.device(device).type == "cpu":
        return None
    return "float32"


def weight_kernels(ckpt: Checkpoint, device: torch.device | str = "cpu", quantization: Optional[str] = None,
                   kernel: Optional[str] = None) -> dict[str, str]:
    """The kernel each weight type of `ckpt`'s matrices (projections, LM head) runs on when
    build_stage loads it here, by build_stage's own choice, e.g. {"Q4_1": "native", "Q8_0":
    "native"}; "float32" = float weights (as stored, or dequantized at load), "dequant" = the
    portable kernel. What a stage on another machine chooses can differ (its library, its CPU)."""
    if kernel is None:
        kernel = default_kernel(device, quantization)
    names = ckpt.names()
    matrices = [n for n in names if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]
    if "lm_head.weight" not in names and "embed_tokens.weight" in names:
        matrices.append("embed_tokens.weight")  # a tied LM head reads the embedding
    found: dict[str, str] = {}
    for name in sorted(matrices):
        qtype = ckpt.stored_type(name)
        if qtype is None or qtype in FLOAT_TYPES:
            if quantization is None or kernel == "float32":
                found[qtype.name if qtype is not None else "float"] = "float32"
                continue
            qtype = QUANTIZATIONS[quantization]
        if kernel == "float32":
            found[qtype.name] = "float32"
        elif qtype.name not in found:
            k = choose_kernel(qtype, device, kernel).name
            found[qtype.name] = "dequant" if k == "int4pack" and name == "embed_tokens.weight" else k
    return found


def _packed_kv_b(ckpt: Checkpoint, name: str, attn: LatentAttention, device, kernel: Optional[str],
                 checked) -> None:
    """A GGUF file's attn_k_b / attn_v_b kept in their blocks where the file quantized them
    (model/mla.py use_packed_halves), instead of joined into kv_b_proj and dequantized to float32:
    a layer of DeepSeek-V2-Lite's Q4_K_M (Q5_0 and Q4_K halves) holds 1.25 MiB, not 8 MiB."""
    halves = getattr(ckpt, "kv_b_halves", None)
    src = f"{name}.kv_b_proj.weight"
    found = halves(src) if halves is not None else None
    if found is None:
        return
    checked(src, attn.kv_b_proj.weight.shape)
    attn.use_packed_halves(*[(q, p.to(device), choose_kernel(q, device, kernel)) for q, p in found])


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def build_stage(ckpt: Checkpoint, spec: StageSpec, device: torch.device | str = "cpu",
                dtype: Optional[torch.dtype] = torch.float32, quantization: Optional[str] = None,
                kernel: Optional[str] = None, stack: bool = True, requantize: bool = False) -> LlamaStage:
    """A `LlamaStage` for `spec` with its weights taken from `ckpt`, every shape checked.

    dtype: the activations' type, and the float weights' when given; None = float32 activations
    with float weights kept as stored. kernel: a kernel name to prefer (kernels/registry.py), or
    "float32" to dequantize every weight to float32 at load as SpecPipe did before (8.5x the
    memory of a Q4 file; kept for comparisons). stack: stack q/k/v and gate/up where the kernel
    allows (stack_projections) and run each layer that qualifies as one native call (model/fused.py);
    False keeps one module per checkpoint tensor and the torch-written layers, for inspection.
    requantize: weights the file stores in wider quantized types become `quantization`'s type too.
    """
    if kernel is None:
        kernel = default_kernel(device, quantization)
    names = ["float32"] + [k.name for k in kernels()]
    if kernel is not None and kernel not in names:
        raise ValueError(f"unknown kernel {kernel!r} (SPECPIPE_KERNEL?); this machine has: {', '.join(names)}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if requantize and quantization is None:
        raise ValueError("requantize needs a quantization to requantize to")
    act = dtype or torch.float32
    cfg = ckpt.config
    native_attention = act == torch.float32 and torch.device(device).type == "cpu" and native.available()
    check_attention_group(ckpt, native.MAX_GROUP if native_attention else None)  # attention.attend's choice
    # Built on the meta device, then every weight replaced by a real one: the stage never holds
    # an uninitialised float32 copy of the weights it keeps quantized.
    with torch.device("meta"):
        model = LlamaStage(cfg, spec, act)
    model.init_rope(device)
    available = ckpt.names()
    tied = spec.first and spec.last and cfg.tie_word_embeddings

    def checked(src: str, want: tuple[int, ...]) -> None:
        if src not in available:
            raise CheckpointError(f"{ckpt.path.name}: tensor {src!r} is missing from the checkpoint")
        shape = tuple(ckpt.shape(src))
        if shape != tuple(want):
            raise CheckpointError(f"{ckpt.path.name}: tensor {src!r} has shape {shape}, the model config "
                                  f"expects {tuple(want)}")

    def load_float(src: str) -> torch.Tensor:
        return ckpt.load(src, dtype).to(device)  # dtype None: as stored

    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf == "lm_head" and tied:
            continue  # shares the embedding, below
        if leaf in ("embed_tokens", "lm_head"):
            src = checkpoint_name(f"{name}.weight", available)
        elif leaf in PROJECTIONS:
            src = f"{name}.weight"
        else:
            continue
        checked(src, module.weight.shape)
        found = _packed(ckpt, src, quantization, kernel, requantize)
        parent, attr = _parent(model, name)
        if found is None:
            module.weight = nn.Parameter(load_float(src), requires_grad=False)
        elif leaf == "embed_tokens":
            setattr(parent, attr, QuantEmbedding(found[1].to(device), found[0], *module.weight.shape))
        else:
            bias = None
            if module.bias is not None:
                checked(f"{name}.bias", module.bias.shape)
                bias = ckpt.load(f"{name}.bias").to(device)
            k = choose_kernel(found[0], device, kernel)
            setattr(parent, attr, QuantLinear(found[1].to(device), found[0], module.in_features,
                                              module.out_features, bias, k))
            if k.name == "int4pack":
                _return_freed_memory()  # its repacking temporaries, 4-8x the tensor: keep the peak low
    if tied:
        emb = model.embed_tokens
        if isinstance(emb, QuantEmbedding):
            # The head reads the embedding's own bytes, so it needs a kernel that keeps them packed.
            k = choose_kernel(emb.qtype, device, kernel)
            if k.name not in ("native", "dequant"):
                k = get_kernel("dequant")
            model.lm_head = QuantLinear(emb.packed, emb.qtype, cfg.hidden_size, cfg.vocab_size, None, k)
        else:
            model.lm_head.weight = emb.weight
    for name, module in list(model.named_modules()):
        if isinstance(module, LatentAttention) and kernel != "float32":
            _packed_kv_b(ckpt, name, module, device, kernel, checked)
    # Everything else (norms, biases of float projections) in the activations' type; the router's
    # weight and selection bias in float32, as transformers keeps them (a bfloat16 bias would move
    # experts' choices: model/routing.py).
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        checked(name, param.shape)
        parent, attr = _parent(model, name)
        keep = torch.float32 if name.endswith(FLOAT32_PARAMS) else act
        setattr(parent, attr, nn.Parameter(ckpt.load(name).to(keep).to(device), requires_grad=False))
    if stack:
        stack_projections(model)
    pack_weights(model)
    if stack:
        fuse_layers(model)
    _return_freed_memory()
    return model.eval().requires_grad_(False)


def stack_projections(model: nn.Module) -> None:
    """Stack each layer's (and expert's) q/k/v and gate/up projections where the kernel allows
    (kernels/qlinear.py StackedLinear): fewer, larger kernel calls per step, the same bits."""
    for m in list(model.modules()):
        if isinstance(m, Attention):
            _stack(m, "qkv", ("q_proj", "k_proj", "v_proj"))
        elif isinstance(m, MLP):
            _stack(m, "gate_up", ("gate_proj", "up_proj"))


def _stack(owner: nn.Module, attr: str, names: tuple[str, ...]) -> None:
    stacked = StackedLinear([getattr(owner, n) for n in names])
    if stacked.num_calls == len(names):
        return  # nothing could be stacked: keep the projections as they are
    for n in names:
        delattr(owner, n)
    setattr(owner, attr, stacked)


# Where a projection's weights go in pack_weights' arena: a layer's in the order its forward reads them.
_READ_ORDER = {"qkv": 0, "q_proj": 0, "k_proj": 1, "v_proj": 2, "o_proj": 3,
               "gate_up": 4, "gate_proj": 4, "up_proj": 5, "down_proj": 6}


def pack_weights(model: nn.Module) -> int:
    """Move the packed weights of the stage's quantized modules on the CPU into one arena
    (loader/weight_memory.py weight_arena: huge pages from its first byte), layer by layer in the
    order a step reads them, the LM head and embedding last. A one-row step then streams one
    contiguous run of memory: the hardware prefetcher and the kernels' own prefetch, which runs
    past the end of one matrix, go on into the next instead of starting over (a decode step of
    Qwen2.5-Coder 1.5B: docs/benchmarks.md §9). Each old buffer is freed as soon as it is copied
    (the modules holding a tensor are handed the copy: use_packed). Must run before anything keeps
    a raw pointer to a weight (the fused layers). Returns the bytes moved."""
    found: dict[int, list] = {}  # data_ptr -> [sort key, tensor, modules holding it]
    for i, (name, m) in enumerate(model.named_modules()):
        t = m.packed if isinstance(m, (QuantLinear, QuantEmbedding)) else None
        if t is None or not t.is_cpu or not t.is_contiguous():
            continue
        if t.data_ptr() in found:  # a tied embedding and LM head
            found[t.data_ptr()][2].append(m)
            continue
        parts = name.split(".")
        at = parts.index("layers") + 1 if "layers" in parts else len(parts)
        layer = int(parts[at]) if at < len(parts) and parts[at].isdigit() else 1 << 30  # the head: last
        rank = next((_READ_ORDER[p] for p in parts if p in _READ_ORDER), len(_READ_ORDER))
        found[t.data_ptr()] = [(layer, rank, i), t, [m]]
    order = sorted(found.values(), key=lambda e: e[0])
    found.clear()
    align = 64  # each tensor on its own cache lines
    sizes = [-(-e[1].numel() // align) * align for e in order]
    arena = weight_arena(sum(sizes))
    offset = 0
    for i, size in enumerate(sizes):
        _, t, holders = order[i]
        order[i] = None  # the old buffer goes with the last reference to it
        view = arena[offset:offset + t.numel()].view(t.shape)
        view.copy_(t)
        for m in holders:
            m.use_packed(view)
        del t
        offset += size
    return offset


def _return_freed_memory() -> None:
    """Hand the load's freed temporaries (a kernel's repacking buffers, float32 tensors being
    quantized) back to the OS: glibc keeps freed heap memory mapped, and it would count as the
    stage's resident memory (int4pack: 560 MB instead of 770 MB for SmolLM2)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def weight_nbytes(model: nn.Module) -> int:
    """Bytes the stage's weights occupy (a tensor shared by two modules counted once)."""
    tensors = list(model.parameters())
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            tensors += m.weight_tensors()
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(unique.values())
