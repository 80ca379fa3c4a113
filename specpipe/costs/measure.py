"""Measure what a stage's step costs on this device: a `CostProfile` (costs/profile.py).

Measured through the stages' own code (StageWorker.step), for n tree rows after `context`
committed tokens that every row attends to (a tree layer's shape): one target decoder layer, the
stage's fixed overhead per step (slot table, tree mask, packing), the final norm + LM head with
the target tokens, and a whole step of the draft model; median of `repeats` runs after a
warm-up. On CUDA every timing synchronises.
The driver's own time per step is not a device cost and is not in the profile (`specpipe sim
--driver-ms`); the links between stage processes are probed by `specpipe profile --probe-links`
(sim/calibrate.py), which runs the engine.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time

DEFAULT_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_CONTEXTS = [256, 1024, 2048, 4096, 8192]
DEFAULT_IDLE_GAPS = [0, 2, 5, 10, 20, 50]  # ms a stage idles before a step (idle_costs)
REQUESTS = 8  # requests sharing a step when the per-request cost is measured


class StageTimer:
    """Times one stage's real step (StageWorker.step: slots, tree mask, packed forward, results)
    for n tree rows below a committed context, the shape of a SpecPipe layer: every row sees the
    context and itself. The rows are pruned again after each run, untimed."""

    def __init__(self, model, contexts: list[int], rows: list[int], device, dtype, sync, requests: int) -> None:
        from specpipe.worker.stage_worker import StageWorker

        block = 16
        per_request = -(-(max(contexts) + max(rows)) // block)
        self.worker = StageWorker(model, per_request * len(contexts) * requests + 8, block)
        self.model, self.device, self.dtype, self.sync = model, device, dtype, sync
        self.contexts: dict[int, list[int]] = {}
        for ctx in contexts:  # `requests` requests per context, each prompt computed once
            self.contexts[ctx] = []
            for _ in range(requests):
                rid = sum(len(v) for v in self.contexts.values())
                self.contexts[ctx].append(rid)
                self._step(rid, list(range(ctx)), [-1] + list(range(ctx - 1)), list(range(ctx)), admit=True)
        self._next_id = max(contexts)

    def _rows(self, rid, node_ids, parents, positions):
        import torch

        from specpipe.messages import Rows

        cfg, n = self.model.cfg, len(node_ids)
        data = (torch.randint(0, cfg.vocab_size, (n,), device=self.device) if self.model.spec.first
                else torch.randn(n, cfg.hidden_size, device=self.device, dtype=self.dtype))
        return Rows(rid, node_ids, parents, positions, data)

    def _step(self, rid, node_ids, parents, positions, admit=False):
        from specpipe.messages import Admit, Control
        from specpipe.sampling import SamplingParams

        control = Control(admit=[Admit(rid, SamplingParams())] if admit else [])
        return self.worker.step(control, [self._rows(rid, node_ids, parents, positions)])

    def ms(self, n: int, context: int, repeats: int, requests: int = 1) -> float:
        """n rows in all, split over `requests` requests at this context."""
        self.step_ms(n, context, requests)  # warm-up
        return statistics.median(self.step_ms(n, context, requests) for _ in range(max(1, repeats)))

    def idle_costs(self, gaps_ms: list[float], context: int, repeats: int) -> list[float]:
        """A one-row step's ms when the stage idles each of `gaps_ms` before every step, as a stage
        of a pipeline does while it waits for the others ((S - 1) / S of the time when one request
        decodes; a profile's steps run back to back). On a machine whose caches others share, what
        the stage left there fades while it waits. Each gap is held for `repeats` steps after one
        untimed step (a sustained pattern, as in a pipeline), twice, the gaps in turn so drift is
        shared; the median of each gap's timed steps."""
        times: list[list[float]] = [[] for _ in gaps_ms]
        for _ in range(2):
            for i, gap in enumerate(gaps_ms):
                for j in range(max(1, repeats) + 1):
                    time.sleep(gap / 1e3)
                    ms = self.step_ms(1, context)
                    if j:
                        times[i].append(ms)
        return [statistics.median(t) for t in times]

    def step_ms(self, n: int, context: int, requests: int = 1) -> float:
        """One timed step of n rows over `requests` requests at this context, pruned afterwards."""
        from specpipe.messages import Control, Prune

        rids = self.contexts[context][:requests]
        shares = [n // len(rids) + (i < n % len(rids)) for i in range(len(rids))]
        batch, prune = [], []
        for rid, k in zip(rids, shares):
            ids = list(range(self._next_id + 1, self._next_id + 1 + k))  # a pruned id never comes back
            self._next_id += k
            batch.append(self._rows(rid, ids, [context - 1] * k, [context] * k))
            prune.append(Prune(rid, drop=ids))
        self.sync()
        t0 = time.perf_counter()
        self.worker.step(Control(), batch)
        self.sync()
        ms = (time.perf_counter() - t0) * 1e3
        self.worker.apply(Control(prune=prune))
        return ms


def measure_checkpoint(model, draft, rows: list[int], contexts: list[int], device: str = "cpu",
                       dtype: str = "auto", threads: int = 0, repeats: int = 3, draft_vocab: int | None = None,
                       draft_quantization: str | None = None, stage_layers: list[int] | None = None,
                       idle_gaps: list[int] | None = None):
    """The cost profile of a checkpoint (the target, and the draft if given, its LM head over
    `draft_vocab` tokens and its weights requantized to `draft_quantization` if given, as
    --draft-vocab and --draft-quantization serve it); `model` None is the embedded default model,
    and a Checkpoint object is used as it is (costs/synthetic.py: random weights of a real shape)."""
    import torch

    from specpipe.config import EngineConfig, StageSpec
    from specpipe.loader import open_checkpoint
    from specpipe.loader.checkpoint import Checkpoint
    from specpipe.loader.default_model import default_model_path
    from specpipe.model.stage import build_stage

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = EngineConfig(device=device, dtype=dtype).torch_dtype()
    dev = torch.device(device)
    target = model or default_model_path()
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(target)
    middle_stage_sizes(ckpt.config.num_layers, stage_layers)  # a bad size fails before the loading
    draft_model, draft_meta = None, None
    if draft:
        dckpt = open_checkpoint(draft)
        draft_model = build_stage(dckpt, StageSpec.whole(dckpt.config), dev, torch_dtype,
                                  quantization=draft_quantization, requantize=draft_quantization is not None)
        draft_meta = {"path": str(draft), "num_layers": dckpt.config.num_layers,
                      "hidden_size": dckpt.config.hidden_size, "quantization": draft_quantization}
        if draft_vocab is not None:
            from specpipe.kernels.qlinear import select_outputs
            from specpipe.tokenizer.tokenizer import Tokenizer

            ids = torch.tensor(Tokenizer.from_path(draft).frequent_ids(draft_vocab))
            draft_model.lm_head = select_outputs(draft_model.lm_head, ids)
            draft_meta["vocab"] = len(ids)
    prof = profile_stages(lambda spec: build_stage(ckpt, spec, dev, torch_dtype), ckpt.config, rows, contexts,
                          repeats, dev, torch_dtype, draft_model, stage_layers, idle_gaps)
    prof.model["path"], prof.draft = str(ckpt.path if isinstance(model, Checkpoint) else target), draft_meta
    return prof


def middle_stage_sizes(num_layers: int, stage_layers: list[int] | None) -> list[int]:
    """The sizes of the middle stages a layer is measured on: `stage_layers` (each 2..num_layers),
    by default one of 8 layers (fewer in a smaller model)."""
    if not stage_layers:
        return [max(2, min(8, num_layers - 1))]
    from specpipe.config import ConfigError

    sizes = sorted(set(stage_layers))
    if sizes[0] < 2 or sizes[-1] > num_layers:
        raise ConfigError(f"--stage-layers must be between 2 and the model's {num_layers} layers, got "
                         f"{','.join(map(str, sizes))}")
    return sizes


def profile_stages(build, cfg, rows: list[int], contexts: list[int], repeats: int, device, dtype, draft=None,
                   stage_layers: list[int] | None = None, idle_gaps: list[int] | None = None):
    """The cost profile of a model whose stages `build(StageSpec)` makes (from a checkpoint, or
    random weights of a given shape), and of a whole draft model if given; a layer is measured
    on middle stages of each size in `stage_layers` (middle_stage_sizes), and what a step costs
    more after the stage idled each of `idle_gaps` ms (DEFAULT_IDLE_GAPS; [] for none)."""
    import torch

    from specpipe.config import StageSpec
    from specpipe.costs.profile import CostProfile

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    L = cfg.num_layers
    # A stage's step = overhead(n) + layers x layer(n, context) [+ head(n) on the last stage]:
    # measured on middle stages of 1 and K layers (slope: a layer; intercept: the overhead; K
    # large so that timing noise is divided by K - 1) and on a last stage of 1 layer (minus the
    # 1-layer middle stage: the head). Larger middle stages (sizes[1:]) give the same slope for
    # stages whose weights and KV no longer fit the caches.
    def timer(start: int, stop: int, last: bool = False) -> StageTimer:
        spec = StageSpec(start, stop, first=False, last=last)
        return StageTimer(build(spec), contexts, rows, device, dtype, sync, REQUESTS)

    sizes = middle_stage_sizes(L, stage_layers)
    K = sizes[0]
    # A mixture of experts' middle stages start at its first sparse layer (DeepSeek V3, GLM-4.5:
    # the first 3 are dense), so a layer's cost by rows is a sparse layer's: n rows read the
    # distinct experts they chose, which EXPERTS_READ counts on the 1-layer stage.
    first = min(cfg.moe.layers[0], L - sizes[-1]) if cfg.moe else 0
    print(f"profile: computing the contexts ({REQUESTS} requests at {', '.join(map(str, contexts))} tokens) "
          f"on stages of 1, {', '.join(map(str, sizes))} and 1 + head layers", file=sys.stderr, flush=True)
    one, tail = timer(first, first + 1), timer(L - 1, L, last=True)
    middles = {k: timer(first, first + k) for k in sizes}
    # The head again on last stages of each size: on a CPU the head's weights stay in the caches
    # of a 1-layer stage run back to back, not beside many layers' (SmolLM2: 1.8-1.9 ms against
    # 2.4-4.5; benchmarks/stage_costs.py head).
    lasts = {k: timer(L - k, L, last=True) for k in sizes}
    many = middles[K]
    gaps = DEFAULT_IDLE_GAPS if idle_gaps is None else sorted({0, *idle_gaps})
    measure_idle = idle_gaps != []
    total = len(contexts) * (len(rows) * (2 * len(sizes) + 2 + (draft is not None)) + 4)
    total += len(sizes) + 2 if measure_idle else 0
    done = 0

    def progress(what: str) -> None:
        nonlocal done
        done += 1
        print(f"\rprofile: {done}/{total} {what:40s}", end="", file=sys.stderr, flush=True)

    from specpipe.model.moe import EXPERTS_READ

    experts: dict[int, list[float]] = {}  # rows -> distinct experts a step read, per context
    layer_ms, head_ms, overhead_ms, request_ms, request_overhead = [], [], [], [], []
    larger: dict[str, list[list[float]]] = {str(k): [] for k in sizes[1:]}
    heads_by: dict[str, list[list[float]]] = {str(k): [] for k in sizes}  # [context][rows]
    for ctx in contexts:
        # What requests beyond the first add: REQUESTS rows as one row each of REQUESTS requests
        # against REQUESTS rows of one request, on both middle stages (slope: per layer).
        t = {(stage, r): timer_.ms(REQUESTS, ctx, repeats, r) for stage, timer_ in ((1, one), (K, many))
             for r in (1, REQUESTS) if progress(f"{REQUESTS} requests, context {ctx}") or True}
        per_layer = max(0.0, ((t[K, REQUESTS] - t[K, 1]) - (t[1, REQUESTS] - t[1, 1])) / (K - 1) / (REQUESTS - 1))
        request_ms.append(per_layer)
        request_overhead.append(max(0.0, (t[1, REQUESTS] - t[1, 1]) / (REQUESTS - 1) - per_layer))
        layers, heads, overheads = [], [], []
        for table in (*larger.values(), *heads_by.values()):
            table.append([])
        for n in rows:
            EXPERTS_READ.reset()
            EXPERTS_READ.on = cfg.moe is not None
            try:
                t1 = one.ms(n, ctx, repeats)
            finally:
                EXPERTS_READ.on = False
            if cfg.moe is not None:
                experts.setdefault(n, []).append(EXPERTS_READ.mean())
            progress(f"1-layer stage, {n} rows, context {ctx}")
            t_last = tail.ms(n, ctx, repeats)
            progress(f"last stage, {n} rows, context {ctx}")
            middle = {}
            for k in sizes:
                middle[k] = middles[k].ms(n, ctx, repeats)
                progress(f"{k}-layer stage, {n} rows, context {ctx}")
                heads_by[str(k)][-1].append(max(0.0, lasts[k].ms(n, ctx, repeats) - middle[k]))
                progress(f"last stage of {k} layers, {n} rows, context {ctx}")
                if k != K:
                    larger[str(k)][-1].append(max(0.0, (middle[k] - t1) / (k - 1)))
            layer = max(0.0, (middle[K] - t1) / (K - 1))
            layers.append(layer)
            overheads.append(max(0.0, t1 - layer))
            heads.append(max(0.0, t_last - t1))
        layer_ms.append(layers)
        head_ms.append(heads)
        overhead_ms.append(overheads)
    idle_layer, idle_head = {}, []
    if measure_idle:
        # What a step costs more after an idle gap than back to back, at one row and the first
        # context: per layer from the middle stages (the 1-layer stage's own rise taken out, as the
        # layer cost above), and for the head from the last stage against the 1-layer stage.
        rise = {}
        for name, timer_ in (("one", one), ("tail", tail), *((k, middles[k]) for k in sizes)):
            cost = timer_.idle_costs(gaps, contexts[0], repeats)
            rise[name] = [c - cost[0] for c in cost]
            progress(f"after idling {', '.join(map(str, gaps))} ms: {name}")
        idle_layer = {str(k): [max(0.0, (r - r1) / (k - 1)) for r, r1 in zip(rise[k], rise["one"])] for k in sizes}
        idle_head = [max(0.0, r - r1) for r, r1 in zip(rise["tail"], rise["one"])]
    draft_ms = []
    if draft is not None:
        timer_ = StageTimer(draft, contexts, rows, device, dtype, sync, 1)
        for ctx in contexts:
            draft_ms.append([timer_.ms(n, ctx, repeats) for n in rows
                             if progress(f"draft, {n} rows, context {ctx}") or True])
    print(file=sys.stderr)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    dtype_name = str(dtype).removeprefix("torch.")
    return CostProfile(
        device=f"{name}, torch {torch.__version__}, {dtype_name}", rows=list(rows), layer_ms=layer_ms,
        # The head and the overhead read no context: their medians over contexts.
        head_ms=[statistics.median(col) for col in zip(*head_ms)], draft_ms=draft_ms, contexts=list(contexts),
        overhead_ms=[statistics.median(col) for col in zip(*overhead_ms)],
        request_ms=request_ms, request_overhead_ms=statistics.median(request_overhead),
        method="measured",
        model={"num_layers": L, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
               **({"num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k} if cfg.moe else {})},
        assumptions=[f"measured with `specpipe profile`: a stage's real step (StageWorker.step), median of "
                     f"{repeats} runs after a warm-up",
                     f"layer: the difference between middle stages of {K} and 1 layers over {K - 1}; overhead: the "
                     "1-layer stage minus a layer; head: the last stage of 1 layer minus the 1-layer stage",
                     *([f"layer_ms_by_stage: the same difference on middle stages of {', '.join(larger)} layers"]
                       if larger else []),
                     f"head_ms_by_stage: last stages of {', '.join(heads_by)} layers minus middle stages of as many",
                     "every row attends to the whole context and itself (one tree layer of one request)",
                     *([f"a sparse layer's cost: the stages start at layer {first}; experts_read: the distinct "
                        "experts its steps ran (random hidden states: a random router's even spread, an upper "
                        "bound for a tree's rows, which share context)"] if cfg.moe else []),
                     f"per extra request: {REQUESTS} rows of {REQUESTS} requests against {REQUESTS} rows of one",
                     "messages between processes are not included: see the link (`specpipe sim --link`)",
                     *([f"idle_layer_ms / idle_head_ms: a one-row step at context {contexts[0]} after the stage "
                        f"idled {', '.join(map(str, gaps))} ms, minus back to back (per layer: middle stages "
                        "minus the 1-layer stage)"] if idle_layer else [])],
        row_bytes=cfg.hidden_size * torch.empty((), dtype=dtype).element_size(),
        stage_layers=K, layer_ms_by_stage=larger,
        head_ms_by_stage={k: [statistics.median(col) for col in zip(*t)] for k, t in heads_by.items()},
        idle_gaps_ms=list(gaps) if idle_layer else [], idle_layer_ms=idle_layer, idle_head_ms=idle_head,
        experts_read=[statistics.median(experts[n]) for n in rows] if experts else [])
