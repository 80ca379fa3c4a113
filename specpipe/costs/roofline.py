"""Roofline cost profiles: what one target decoder layer, the LM head and one draft forward would
cost on a GPU, derived from the device's published specifications and the model's shape (docs/design.md §10).

Each part of a step (a decoder layer, the LM head, the embedding) of n rows at context c is bound
by the slower of two resources, plus a fixed cost per kernel:

  ms = max(bytes / (bandwidth * bandwidth_eff), flops / (bf16 peak * flops_eff)) + kernels * kernel_us

bytes are the weights (read once per step whatever n), the KV cache the rows attend to, the KV
they write and the activations each kernel reads and writes; flops are 2 per weight per row plus
attention. In bf16 a weight is 2 bytes and costs 2 flops per row, so a layer turns compute-bound
near n = (peak * flops_eff) / (bandwidth * bandwidth_eff) rows: about 124 on an A100, 240 on an
H100 (a little more, since activations add bytes).

Every number used goes into the profile's `assumptions`; docs/roofline.md explains them and
`python -m specpipe.costs.roofline` rewrites the shipped profiles in specpipe/costs/profiles/.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from specpipe.costs.profile import PROFILES_DIR, CostProfile, Link

DEFAULT_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_CONTEXTS = [256, 512, 1024, 2048, 4096, 8192]
GIB = 2**30
# Share of device memory a serving stack can use for weights and KV (vLLM's default
# gpu_memory_utilization); the rest is the CUDA context, activations and fragmentation.
USABLE_MEMORY = 0.9
HEAD_KERNELS = 2  # final RMSNorm, LM-head GEMM
EMBED_KERNELS = 1  # one gather


# ---- devices ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU: its datasheet numbers, then what a serving stack achieves on it (assumptions)."""

    key: str  # preset name, as in profile file names
    name: str  # as torch.cuda.get_device_name() reports it
    bandwidth_gbs: float  # HBM, 10^9 bytes/s
    bf16_tflops: float  # dense tensor-core BF16 peak (datasheets also print 2x "with sparsity")
    memory_gib: float
    source: str
    bandwidth_eff: float = 0.80  # decode GEMVs stream large weights at 80-90% of HBM peak
    flops_eff: float = 0.65  # cuBLAS: 70-80% on large square GEMMs, less on n-row decode GEMMs
    kernel_us: float = 4.0  # launch gap + ramp-up/tail per kernel, host launching ahead (CUDA graphs)

    def memory_ms(self, nbytes: float) -> float:
        return nbytes / (self.bandwidth_gbs * self.bandwidth_eff * 1e9) * 1e3

    def compute_ms(self, flops: float) -> float:
        return flops / (self.bf16_tflops * self.flops_eff * 1e12) * 1e3

    def time_ms(self, work: Work) -> float:
        bound = max(self.memory_ms(work.bytes), self.compute_ms(work.flops))
        return bound + work.kernels * self.kernel_us / 1e3


A100_80GB = DeviceSpec(
    "a100-80gb", "NVIDIA A100-SXM4-80GB", bandwidth_gbs=2039, bf16_tflops=312, memory_gib=80,
    source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: 2,039 GB/s HBM2e, "
           "BF16 Tensor Core 312 TFLOPS dense (624 with sparsity), 80GB")
H100_80GB = DeviceSpec(
    "h100-80gb", "NVIDIA H100 80GB HBM3", bandwidth_gbs=3350, bf16_tflops=989, memory_gib=80,
    source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 3.35 TB/s HBM3, "
           "BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense), 80GB")
H200 = DeviceSpec(
    "h200", "NVIDIA H200", bandwidth_gbs=4800, bf16_tflops=989, memory_gib=141,
    source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 4.8 TB/s HBM3e, "
           "BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense), 141GB")
DEVICES = {d.key: d for d in (A100_80GB, H100_80GB, H200)}


# ---- models -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama-family decoder; field names as in specpipe.config.ModelConfig."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    bytes_per_param: int = 2  # bf16 weights, activations and KV cache
    source: str = ""

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden_size
        attention = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h  # q, k, v, o
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attention + mlp + 2 * h  # + two RMSNorm weights

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        tables = 1 if self.tie_word_embeddings else 2  # embedding and LM head
        return self.num_layers * self.layer_params + tables * self.embed_params + self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache of one token in one layer: K and V, kv_heads x head_dim each."""
        return 2 * self.kv_dim * self.bytes_per_param

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "source"},
                "layer_params": self.layer_params, "params": self.params,
                "kv_bytes_per_token_layer": self.kv_bytes_per_token}


LLAMA_31_70B = ModelShape(
    "llama-3.1-70b", num_layers=80, hidden_size=8192, intermediate_size=28672, num_heads=64,
    num_kv_heads=8, head_dim=128, vocab_size=128256,
    source="meta-llama/Llama-3.1-70B config.json")
LLAMA_32_1B = ModelShape(
    "llama-3.2-1b", num_layers=16, hidden_size=2048, intermediate_size=8192, num_heads=32,
    num_kv_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
    source="meta-llama/Llama-3.2-1B config.json")
MODELS = {m.name: m for m in (LLAMA_31_70B, LLAMA_32_1B)}


# ---- links ------------------------------------------------------------------------------------

# Bandwidths are signalling rates per direction (no protocol overhead); latencies are one message,
# software included. Calculon (Isaev et al., SC'23; systems/a100_80g.json) models an A100
# NVLink hop at 10 us and an InfiniBand hop at 20 us.
LINKS = {
    # 10 Gb/s = 1.25 GB/s (TCP goodput ~94% of it). 50 us: a kernel-TCP hop is 15-30 us one way
    # (half a netperf TCP_RR round trip) and torch.distributed's send/recv over sockets adds as much.
    "10gbe": Link("10gbe", 0.05, 1.25),
    # 1 Gb/s = 0.125 GB/s (the same ~94% goodput rounds to it). 100 us: home and office NICs
    # coalesce interrupts and a switch stores and forwards each frame (12 us per 1500 bytes).
    "1gbe": Link("1gbe", 0.1, 0.125),
    # InfiniBand EDR / HDR100, 100 Gb/s = 12.5 GB/s. The wire is ~1 us; NCCL's send/recv through
    # its network proxy thread dominates: 20 us as in Calculon.
    "ib-100g": Link("ib-100g", 0.02, 12.5),
    # A100 NVLink 3: 600 GB/s bidirectional per GPU (datasheet) = 300 GB/s per direction.
    # 10 us including NCCL's kernel launch, as in Calculon.
    "nvlink3": Link("nvlink3", 0.01, 300.0),
    # H100 NVLink 4: 900 GB/s bidirectional (datasheet) = 450 per direction; a p2p test reaches
    # 380 (NVIDIA/nccl issue 1264). 10 us as NVLink 3.
    "nvlink4": Link("nvlink4", 0.01, 450.0),
}


# ---- work of each part of a step --------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    bytes: float  # moved to or from device memory
    flops: float
    kernels: int


def _layer_kernel_traffic(m: ModelShape) -> list[int]:
    """Activation values per row that each kernel of a fused decoder layer reads + writes."""
    h, q, kv, i = m.hidden_size, m.q_dim, m.kv_dim, m.intermediate_size
    return [
        h + h,  # RMSNorm
        h + (q + 2 * kv),  # QKV GEMM
        (q + 2 * kv) + q,  # RoPE on q, k; k and v into the cache (counted as KV write)
        q + q,  # attention (the KV it reads is counted apart)
        q + h,  # O GEMM
        2 * h + 2 * h,  # residual add + RMSNorm: keeps the residual, writes the normed copy
        h + 2 * i,  # gate/up GEMM
        2 * i + i,  # SiLU(gate) * up
        i + h,  # down GEMM
        2 * h + h,  # residual add
    ]


def layer_work(m: ModelShape, n: int, context: int) -> Work:
    """One decoder layer for n rows of one request (tree nodes share its KV) at this context."""
    traffic = _layer_kernel_traffic(m)
    nbytes = (m.layer_params * m.bytes_per_param  # every weight once, whatever n
              + context * m.kv_bytes_per_token  # the request's KV, read once for all its rows
              + n * m.kv_bytes_per_token  # the rows' new K, V
              + n * sum(traffic) * m.bytes_per_param)
    flops = 2 * m.layer_params * n + 4 * n * context * m.q_dim  # GEMMs + QK^T and PV
    return Work(nbytes, flops, len(traffic))


def head_work(m: ModelShape, n: int) -> Work:
    """Final RMSNorm + hidden x vocab GEMM for n rows; bf16 logits, no sampling."""
    h, v = m.hidden_size, m.vocab_size
    nbytes = (h + v * h + n * (2 * h + h + v)) * m.bytes_per_param
    return Work(nbytes, 2 * v * h * n, HEAD_KERNELS)


def embed_work(m: ModelShape, n: int) -> Work:
    """Gather n rows of the embedding table (only those rows are read)."""
    return Work(2 * n * m.hidden_size * m.bytes_per_param, 0, EMBED_KERNELS)


def layer_ms(d: DeviceSpec, m: ModelShape, n: int, context: int) -> float:
    return d.time_ms(layer_work(m, n, context))


def head_ms(d: DeviceSpec, m: ModelShape, n: int) -> float:
    return d.time_ms(head_work(m, n))


def draft_ms(d: DeviceSpec, m: ModelShape, n: int, context: int) -> float:
    """A whole draft forward on one device: embedding, every layer, LM head."""
    return d.time_ms(embed_work(m, n)) + m.num_layers * layer_ms(d, m, n, context) + head_ms(d, m, n)


# ---- memory check -----------------------------------------------------------------------------


def stage_memory_note(d: DeviceSpec, m: ModelShape, stages: int, contexts: Sequence[int]) -> str:
    """Check that the heaviest stage fits with KV room for the longest context; say so in a sentence."""
    layers = math.ceil(m.num_layers / stages)
    # The last stage holds the LM head (the first the embedding, as large); one stage holds both.
    tables = 2 if stages == 1 and not m.tie_word_embeddings else 1
    weights = (layers * m.layer_params + tables * m.embed_params) * m.bytes_per_param
    usable = USABLE_MEMORY * d.memory_gib * GIB
    kv_per_token = layers * m.kv_bytes_per_token
    kv_tokens = int((usable - weights) // kv_per_token) if usable > weights else 0
    if kv_tokens < max(contexts):
        raise ValueError(f"{m.name} in {stages} stages does not fit on {d.key}: the heaviest stage "
                         f"holds {weights / 1e9:.1f} GB of weights of {usable / 1e9:.1f} GB usable")
    return (f"Memory: the heaviest of {stages} stages holds {layers} layers of {m.name} plus the LM "
            f"head, {weights / 1e9:.1f} GB of weights; {USABLE_MEMORY:.0%} of the {d.memory_gib:g} GiB "
            f"({d.memory_gib * GIB / 1e9:.1f} GB) of {d.name} leaves {(usable - weights) / 1e9:.1f} GB "
            f"for KV at {kv_per_token} bytes per token, {kv_tokens} tokens "
            f"({kv_tokens // max(contexts)} requests at {max(contexts)} tokens).")


# ---- profiles ---------------------------------------------------------------------------------


def _model_sentence(role: str, m: ModelShape) -> str:
    return (f"{role} {m.name} ({m.source}): {m.num_layers} layers, hidden {m.hidden_size}, intermediate "
            f"{m.intermediate_size}, {m.num_heads} query and {m.num_kv_heads} KV heads of dim {m.head_dim}, "
            f"vocab {m.vocab_size}{', tied embeddings' if m.tie_word_embeddings else ''}; "
            f"{m.layer_params / 1e6:.1f}M parameters per layer "
            f"({m.layer_params * m.bytes_per_param / 1e9:.3f} GB), {m.params / 1e9:.2f}B in all.")


def assumptions(d: DeviceSpec, m: ModelShape, draft: ModelShape | None, stages: int,
                contexts: Sequence[int]) -> list[str]:
    """Every number and simplification behind a roofline profile, as plain sentences."""
    layer_kernels = len(_layer_kernel_traffic(m))
    notes = [
        (f"Device {d.name}: {d.bandwidth_gbs:g} GB/s memory bandwidth, {d.bf16_tflops:g} TFLOPS dense "
         f"BF16, {d.memory_gib:g} GiB ({d.source})."),
        (f"Achieved bandwidth {d.bandwidth_eff:.0%} of peak ({d.bandwidth_gbs * d.bandwidth_eff:g} GB/s): "
         f"decode GEMVs streaming large weights reach 80-90% of HBM peak."),
        (f"Achieved BF16 throughput {d.flops_eff:.0%} of peak ({d.bf16_tflops * d.flops_eff:g} TFLOPS): "
         f"cuBLAS reaches 70-80% on large square GEMMs, less on the n-row GEMMs of decode."),
        (f"Each kernel adds {d.kernel_us:g} us (launch gap and ramp-up/tail, the host launching ahead as "
         f"with CUDA graphs); a fused decoder layer is {layer_kernels} kernels (2 RMSNorms, QKV GEMM, "
         f"RoPE + KV write, attention, O GEMM, gate/up GEMM, SiLU*mul, down GEMM, residual add) = "
         f"{layer_kernels * d.kernel_us / 1e3:g} ms; the LM head is {HEAD_KERNELS}, the embedding "
         f"{EMBED_KERNELS}."),
        ("Each part of a step (decoder layer, LM head, embedding) costs max(bytes / achieved bandwidth, "
         "flops / achieved throughput) + its kernels; one roofline per part, not per kernel, which is "
         "optimistic by up to 2x near the ridge point."),
        ("Bytes of a layer: its weights once per step whatever the rows; the KV of the context read once "
         "(context x 2 x kv_heads x head_dim x 2 bytes), since a step's rows are one request's tree nodes "
         "sharing its KV (several requests in a step would each read their own); the rows' new K and V "
         "written; activations read and written once by each kernel."),
        ("FLOPs of a layer: 2 per weight per row, plus attention 4 x rows x context x heads x head_dim "
         "(QK^T and PV)."),
        ("LM head: final RMSNorm and hidden x vocab GEMM for every row, weights read once, bf16 logits; "
         "sampling and top-k are not costed."),
        "Weights, activations and KV cache in bf16 (2 bytes); no quantization.",
        ("One device per stage: no tensor parallelism; no overlap of communication and compute within "
         "a stage; prefill chunks are rows like any other."),
        ("Ignored: L2 cache reuse across steps (a layer's weights far exceed the L2), clock and power "
         "throttling, tensor-core tile padding at small row counts, host-side Python overhead "
         "(SpecPipe's eager model launches ~40 kernels per layer: measure it to include it)."),
        _model_sentence("Target", m),
        stage_memory_note(d, m, stages, contexts),
    ]
    if draft is not None:
        notes += [
            _model_sentence("Draft", draft),
            (f"Draft forward: embedding gather, all {draft.num_layers} layers and the LM head for the new "
             f"rows at the same context, on one {d.name} like a stage (the draft is not split); "
             f"its {draft.params * draft.bytes_per_param / 1e9:.1f} GB of weights fit on one device."),
        ]
    notes.append("Costs are computed at the listed rows and contexts; CostProfile interpolates between them.")
    return notes


def roofline_profile(d: DeviceSpec, m: ModelShape, draft: ModelShape | None = None,
                     rows: Sequence[int] = DEFAULT_ROWS, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                     stages: int = 8) -> CostProfile:
    """A CostProfile for m (and its draft) on d; `stages` only sizes the memory check."""
    rows, contexts = list(rows), list(contexts)

    def ms(x: float) -> float:
        return round(x, 6)  # 1 ns: readable files, and the same floats on every machine

    return CostProfile(
        device=d.name,
        rows=rows,
        layer_ms=[[ms(layer_ms(d, m, n, c)) for n in rows] for c in contexts],
        head_ms=[ms(head_ms(d, m, n)) for n in rows],
        draft_ms=[[ms(draft_ms(d, draft, n, c)) for n in rows] for c in contexts] if draft else [],
        contexts=contexts,
        method="roofline",
        model={**m.to_dict(), "stages": stages},
        draft=draft.to_dict() if draft else None,
        assumptions=assumptions(d, m, draft, stages, contexts),
        row_bytes=m.hidden_size * m.bytes_per_param,
        # Each request beyond the first reads its own KV (no extra kernel: varlen attention).
        request_ms=[ms(d.memory_ms(c * m.kv_bytes_per_token)) for c in contexts],
    )


def _lookup(table: dict, kind: str, name: str):
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(table)}")
    return table[name]


def build(device: str, model: str, draft: str | None, rows=None, contexts=None,
          stages: int = 8) -> CostProfile:
    """The roofline profile for preset names (what `specpipe profile --roofline` will call)."""
    return roofline_profile(_lookup(DEVICES, "device", device), _lookup(MODELS, "model", model),
                            _lookup(MODELS, "draft", draft) if draft else None,
                            rows or DEFAULT_ROWS, contexts or DEFAULT_CONTEXTS, stages)


# ---- shipped files ----------------------------------------------------------------------------

SHIPPED = [(dev, "llama-3.1-70b", "llama-3.2-1b", 8) for dev in DEVICES]


def profile_filename(device: str, model: str, draft: str | None, stages: int) -> str:
    return f"{device}_{model}_s{stages}" + (f"_draft-{draft}" if draft else "") + ".json"


def write_shipped_profiles(out_dir: str | Path = PROFILES_DIR) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for device, model, draft, stages in SHIPPED:
        path = out / profile_filename(device, model, draft, stages)
        build(device, model, draft, stages=stages).save(path)
        paths.append(path)
    return paths


def summary(context: int = 1024, stages: int = 8) -> str:
    """The derived numbers of docs/roofline.md, as Markdown tables (ms)."""
    m, dr = LLAMA_31_70B, LLAMA_32_1B
    per_stage = math.ceil(m.num_layers / stages)
    header = ("| device | layer 1 row | 8 | 64 | 256 | head 1 | head 64 | stage 1 | target 1 | draft 1 "
              "| draft / target |")
    lines = [f"Context {context}; stage: the last of {stages} ({per_stage} layers + head); target: all.",
             "", header, "|---|" + "--:|" * 10]
    for d in DEVICES.values():
        layer = [layer_ms(d, m, n, context) for n in (1, 8, 64, 256)]
        head = [head_ms(d, m, n) for n in (1, 64)]
        stage = per_stage * layer[0] + head[0]
        target = d.time_ms(embed_work(m, 1)) + m.num_layers * layer[0] + head[0]
        draft = draft_ms(d, dr, 1, context)
        cells = [f"{x:.3f}" for x in layer + head] + [f"{stage:.2f}", f"{target:.1f}", f"{draft:.2f}"]
        lines.append(f"| {d.key} | " + " | ".join(cells) + f" | {draft / target:.1%} |")
    row = m.hidden_size * m.bytes_per_param
    lines += ["", f"| link | 1 row ({row} B) | 64 rows |", "|---|--:|--:|"]
    lines += [f"| {k} | {x.transfer_ms(row):.4f} | {x.transfer_ms(64 * row):.4f} |" for k, x in LINKS.items()]
    return "\n".join(lines)


def main() -> None:
    for path in write_shipped_profiles():
        print(f"wrote {path}")
    print(summary())


if __name__ == "__main__":
    main()
