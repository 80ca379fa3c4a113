"""`specpipe profile`: measure a cost profile on this device, or derive one from a roofline.

    specpipe profile --out cpu.json [--model M] [--draft D] [--rows 1,2,...] [--contexts 256,...]
    specpipe profile --roofline h100-80gb --target-shape llama-3.1-70b --draft-shape llama-3.2-1b --out h100.json

Measured through the stages' own code (StageWorker.step), for n tree rows after `context`
committed tokens that every row attends to (a tree layer's shape): one target decoder layer, the
stage's fixed overhead per step (slot table, tree mask, packing), the final norm + LM head with
the target tokens, and a whole step of the draft model; median of `--repeats` runs after a
warm-up. On CUDA every timing synchronises.
The driver's own time per step is not a device cost and is not in the profile (`specpipe sim
--driver-ms`).
"""

from __future__ import annotations

import argparse
import platform
from dataclasses import asdict
import statistics
import sys
import time

DEFAULT_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_CONTEXTS = [256, 1024, 2048, 4096, 8192]
REQUESTS = 8  # requests sharing a step when the per-request cost is measured


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="write the profile (JSON) here")
    p.add_argument("--model", default=None, help="target GGUF file or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="draft model to profile (a path; default: none)")
    p.add_argument("--rows", type=_ints, default=DEFAULT_ROWS, help="row counts (default 1,2,4,...,256)")
    p.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS, help="context lengths (default 256,...,8192)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median; default 3)")
    p.add_argument("--probe-links", type=_ints, default=[],
                   help="also measure the link between local stage processes for these stage counts, "
                        "e.g. 1,2: idle (saved as loopback-sS) and while the stages compute (loopback-sS-busy)")
    p.add_argument("--roofline", metavar="DEVICE", default=None,
                   help="derive the profile from a device's published specifications instead of measuring")
    p.add_argument("--target-shape", default="llama-3.1-70b", help="with --roofline: the target's shape preset")
    p.add_argument("--draft-shape", default="llama-3.2-1b", help="with --roofline: the draft's shape preset ('none')")
    p.add_argument("--stages", type=int, default=8, help="with --roofline: stages (checks a stage's weights fit)")


def main(args: argparse.Namespace) -> int:
    from specpipe.config import ConfigError

    if args.roofline:
        from specpipe.sim import roofline

        try:
            prof = roofline.build(args.roofline, args.target_shape,
                                  None if args.draft_shape == "none" else args.draft_shape,
                                  args.rows, args.contexts, args.stages)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        prof = measure(args)
        for S in args.probe_links:
            for link in probe_link(args.model, S, args.device, args.threads):
                prof.links[link.name] = asdict(link)
                print(f"link {link.name}: {link.latency_ms:.3f} ms per message", file=sys.stderr)
    prof.save(args.out)
    print(f"wrote {args.out} ({prof.method}, {prof.device})", file=sys.stderr)
    return 0


def _timed(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    out = []
    for _ in range(max(1, repeats)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def probe_link(model, num_stages: int, device: str = "cpu", threads: int = 0, steps: int = 300):
    """The link between the driver and local stage processes, as the simulator sees it, twice:

      idle  steps with no rows cost only their messages (control out to every stage, the previous
            step's output in, results back), so half an empty step's round trip is one message;
      busy  one request decoding in pp (one row crossing the stages' real layers): the median gap
            along the row's path, from the driver's send to stage 1's start, from each stage's end
            to the next one's start and from the last stage's end to the driver's receipt, as the
            stages' own spans time them. Where processes share cores, a message between
            computing processes can cost more than an idle one."""
    import torch

    from specpipe.distributed.transport import LinkOptions
    from specpipe.engine.core import EngineCore
    from specpipe.engine.default_model import default_model_path
    from specpipe.engine.launcher import local_processes
    from specpipe.loader import open_checkpoint
    from specpipe.loader.partition import partition_layers
    from specpipe.messages import Control
    from specpipe.request import Request
    from specpipe.sampling import SamplingParams
    from specpipe.sim.profile import Link
    from specpipe.sim.trace import StepTracer

    path = model or default_model_path()
    specs = partition_layers(open_checkpoint(path).config.num_layers, num_stages)
    pipe = local_processes(path, specs, 16, 16, device, torch.float32, LinkOptions(), threads=threads)
    try:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            pipe.step(Control(), [])
            times.append((time.perf_counter() - t0) * 1e3)
        core = EngineCore(pipe, "pp", kv_blocks=16, block_size=16)
        core.tracer = StepTracer(num_stages)
        core.run([Request(0, [1, 2, 3, 4], SamplingParams(max_tokens=max(8, steps // (4 * num_stages))), frozenset())],
                 on_finish=lambda _r: core.request_stage_stats())
        trace = core.tracer.finish()
    finally:
        pipe.close()
    gaps, last = [], num_stages - 1
    for before, step in zip(trace.steps, trace.steps[1:]):
        spans = step.stage_spans
        if not spans:
            continue
        if spans[0] and step.rows[0] == 1:
            gaps.append(spans[0][0] - step.t_submit)
        gaps += [spans[s][0] - before.stage_spans[s - 1][1] for s in range(1, num_stages)
                 if spans[s] and before.stage_spans and before.stage_spans[s - 1]]
        if spans[last] and step.rows[last] == 1:
            gaps.append(step.t_collect - spans[last][1])
    idle = statistics.median(times[steps // 5:]) / 2
    busy = statistics.median(gaps[len(gaps) // 5:]) * 1e3 if gaps else idle
    return [Link(f"loopback-s{num_stages}", idle, 0.0), Link(f"loopback-s{num_stages}-busy", busy, 0.0)]


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
        from specpipe.messages import Control, Prune

        rids = self.contexts[context][:requests]
        shares = [n // len(rids) + (i < n % len(rids)) for i in range(len(rids))]
        out = []
        for i in range(max(1, repeats) + 1):  # the first run warms up
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
            if i:
                out.append((time.perf_counter() - t0) * 1e3)
            self.worker.apply(Control(prune=prune))
        return statistics.median(out)


def measure(args: argparse.Namespace):
    """`specpipe profile` on a checkpoint (the target, and the draft if given)."""
    import torch

    from specpipe.config import EngineConfig, StageSpec
    from specpipe.engine.default_model import default_model_path
    from specpipe.loader import open_checkpoint
    from specpipe.model.stage import build_stage

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = EngineConfig(device=args.device, dtype=args.dtype).torch_dtype()
    device = torch.device(args.device)
    target = args.model or default_model_path()
    ckpt = open_checkpoint(target)
    draft, draft_meta = None, None
    if args.draft:
        dckpt = open_checkpoint(args.draft)
        draft = build_stage(dckpt, StageSpec.whole(dckpt.config), device, dtype)
        draft_meta = {"path": str(args.draft), "num_layers": dckpt.config.num_layers,
                      "hidden_size": dckpt.config.hidden_size}
    prof = profile_stages(lambda spec: build_stage(ckpt, spec, device, dtype), ckpt.config, args.rows, args.contexts,
                          args.repeats, device, dtype, draft)
    prof.model["path"], prof.draft = str(target), draft_meta
    return prof


def profile_stages(build, cfg, rows: list[int], contexts: list[int], repeats: int, device, dtype, draft=None):
    """The cost profile of a model whose stages `build(StageSpec)` makes (from a checkpoint, or
    random weights of a given shape), and of a whole draft model if given."""
    import torch

    from specpipe.config import StageSpec
    from specpipe.sim.profile import CostProfile

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    L = cfg.num_layers
    # A stage's step = overhead(n) + layers x layer(n, context) [+ head(n) on the last stage]:
    # measured on middle stages of 1 and K layers (slope: a layer; intercept: the overhead; K
    # large so that timing noise is divided by K - 1) and on a last stage of 1 layer (minus the
    # 1-layer middle stage: the head).
    def timer(start: int, stop: int, last: bool = False) -> StageTimer:
        spec = StageSpec(start, stop, first=False, last=last)
        return StageTimer(build(spec), contexts, rows, device, dtype, sync, REQUESTS)

    K = max(2, min(8, L - 1))
    print(f"profile: computing the contexts ({REQUESTS} requests at {', '.join(map(str, contexts))} tokens) "
          f"on stages of 1, {K} and 1 + head layers", file=sys.stderr, flush=True)
    one, many, tail = timer(0, 1), timer(0, K), timer(L - 1, L, last=True)
    total = len(contexts) * (len(rows) * (4 if draft is not None else 3) + 4)
    done = 0

    def progress(what: str) -> None:
        nonlocal done
        done += 1
        print(f"\rprofile: {done}/{total} {what:40s}", end="", file=sys.stderr, flush=True)

    layer_ms, head_ms, overhead_ms, request_ms, request_overhead = [], [], [], [], []
    for ctx in contexts:
        # What requests beyond the first add: REQUESTS rows as one row each of REQUESTS requests
        # against REQUESTS rows of one request, on both middle stages (slope: per layer).
        t = {(stage, r): timer_.ms(REQUESTS, ctx, repeats, r) for stage, timer_ in ((1, one), (K, many))
             for r in (1, REQUESTS) if progress(f"{REQUESTS} requests, context {ctx}") or True}
        per_layer = max(0.0, ((t[K, REQUESTS] - t[K, 1]) - (t[1, REQUESTS] - t[1, 1])) / (K - 1) / (REQUESTS - 1))
        request_ms.append(per_layer)
        request_overhead.append(max(0.0, (t[1, REQUESTS] - t[1, 1]) / (REQUESTS - 1) - per_layer))
        layers, heads, overheads = [], [], []
        for n in rows:
            t1 = one.ms(n, ctx, repeats)
            progress(f"1-layer stage, {n} rows, context {ctx}")
            tk = many.ms(n, ctx, repeats)
            progress(f"{K}-layer stage, {n} rows, context {ctx}")
            t_last = tail.ms(n, ctx, repeats)
            progress(f"last stage, {n} rows, context {ctx}")
            layer = max(0.0, (tk - t1) / (K - 1))
            layers.append(layer)
            overheads.append(max(0.0, t1 - layer))
            heads.append(max(0.0, t_last - t1))
        layer_ms.append(layers)
        head_ms.append(heads)
        overhead_ms.append(overheads)
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
        model={"num_layers": L, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
        assumptions=[f"measured with `specpipe profile`: a stage's real step (StageWorker.step), median of "
                     f"{repeats} runs after a warm-up",
                     f"layer: the difference between middle stages of {K} and 1 layers over {K - 1}; overhead: the "
                     "1-layer stage minus a layer; head: the last stage of 1 layer minus the 1-layer stage",
                     "every row attends to the whole context and itself (one tree layer of one request)",
                     f"per extra request: {REQUESTS} rows of {REQUESTS} requests against {REQUESTS} rows of one",
                     "messages between processes are not included: see the link (`specpipe sim --link`)"],
        row_bytes=cfg.hidden_size * torch.empty((), dtype=dtype).element_size())
