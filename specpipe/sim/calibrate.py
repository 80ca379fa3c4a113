"""`specpipe profile`: a cost profile for the planner and the simulator, measured on this device
(costs/measure.py) or derived from a device's published specifications (costs/roofline.py), and,
with `--probe-links`, the links between local stage processes as the simulator sees them. The
link probe runs the engine (one request in pp), which is why this command lives above it, in sim/.

    specpipe profile --out cpu.json [--model M] [--draft D] [--rows 1,2,...] [--contexts 256,...]
    specpipe profile --roofline h100-80gb --target-shape llama-3.1-70b --draft-shape llama-3.2-1b --out h100.json
    specpipe profile --synthetic llama-3.1-70b [--type-mix q4_k_m] --rows 1,2,...,64 --out cpu_70b.json

`--synthetic` measures a model that is not here: its stages built from random weights in the
block types its GGUF file would hold (costs/synthetic.py), through the same code as a real file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict

from specpipe.costs.measure import DEFAULT_CONTEXTS, DEFAULT_IDLE_GAPS, DEFAULT_ROWS


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _gaps(text: str) -> list[int]:
    return [] if text.strip().lower() == "none" else _ints(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="write the profile (JSON) here")
    p.add_argument("--model", default=None, help="target GGUF file or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="draft model to profile (a path; default: none)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="the draft's LM head over its N most frequent tokens, as `--draft-vocab` serves it")
    p.add_argument("--draft-quantization", default=None, choices=["int8", "int4"],
                   help="the draft's weights requantized at load, as `--draft-quantization` serves them")
    p.add_argument("--rows", type=_ints, default=DEFAULT_ROWS, help="row counts (default 1,2,4,...,256)")
    p.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS, help="context lengths (default 256,...,8192)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--stage-layers", type=_ints, default=None,
                   help="measure a layer on middle stages of these sizes (default 8); add the sizes of the "
                        "stages you will run when their weights outgrow the caches, e.g. 8,15,29")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median; default 3)")
    p.add_argument("--idle-gaps", type=_gaps, default=DEFAULT_IDLE_GAPS[1:],
                   help="also measure what a step costs more after the stage idled this many ms (default "
                        f"{','.join(map(str, DEFAULT_IDLE_GAPS[1:]))}; 'none' to skip): on a machine whose caches "
                        "others share, a pipeline stage waiting for the rest loses what it left there")
    p.add_argument("--probe-links", type=_ints, default=[],
                   help="also measure the link between local stage processes for these stage counts, "
                        "e.g. 1,2: idle (saved as loopback-sS) and while the stages compute (loopback-sS-busy)")
    p.add_argument("--synthetic", metavar="NAME", default=None,
                   help="measure random weights of a model's shapes instead of a file: a preset "
                        "(qwen2.5-32b, llama-3.1-70b, qwen3-30b-a3b, deepseek-v3, glm-4.6, qwen2.5-coder-1.5b, "
                        "qwen2.5-coder-0.5b; NAME:eN keeps N of a mixture's experts, each of its shape) "
                        "or a Hugging Face config.json")
    p.add_argument("--type-mix", default="q4_k_m",
                   help="with --synthetic: the weights' GGML types, q4_k_m (llama.cpp's rule) or one type (q8_0, ...)")
    p.add_argument("--roofline", metavar="DEVICE", default=None,
                   help="derive the profile from a device's published specifications instead of measuring")
    p.add_argument("--target-shape", default="llama-3.1-70b", help="with --roofline: the target's shape preset")
    p.add_argument("--draft-shape", default="llama-3.2-1b", help="with --roofline: the draft's shape preset ('none')")
    p.add_argument("--stages", type=int, default=8, help="with --roofline: stages (checks a stage's weights fit)")


def main(args: argparse.Namespace) -> int:
    from specpipe.config import ConfigError

    if args.roofline:
        from specpipe.costs import roofline

        try:
            prof = roofline.build(args.roofline, args.target_shape,
                                  None if args.draft_shape == "none" else args.draft_shape,
                                  args.rows, args.contexts, args.stages)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        from specpipe.costs.measure import measure_checkpoint

        model = args.model
        if args.synthetic:
            if args.model or args.probe_links:
                raise ConfigError("--synthetic measures a model of its own: no --model or --probe-links with it")
            model = synthetic_checkpoint(args.synthetic, args.type_mix)
        prof = measure_checkpoint(model, args.draft, args.rows, args.contexts, args.device, args.dtype,
                                  args.threads, args.repeats, args.draft_vocab, args.draft_quantization,
                                  args.stage_layers, args.idle_gaps)
        if args.synthetic:
            describe_synthetic(prof, model)
        for S in args.probe_links:
            for link in probe_link(args.model, S, args.device, args.threads):
                prof.links[link.name] = asdict(link)
                print(f"link {link.name}: {link.latency_ms:.3f} ms per message", file=sys.stderr)
    prof.save(args.out)
    print(f"wrote {args.out} ({prof.method}, {prof.device})", file=sys.stderr)
    return 0


def synthetic_checkpoint(name: str, mix: str):
    from specpipe.config import ConfigError
    from specpipe.costs import synthetic

    short, cfg = synthetic.model_config(name)
    try:
        return synthetic.SyntheticCheckpoint(short, cfg, mix)
    except ValueError as e:
        raise ConfigError(f"--type-mix: {e}") from None


def describe_synthetic(prof, ckpt) -> None:
    """What the profile's model is, in the profile: its name, type mix, the types of the layers
    the layer cost was measured on and the bytes a token reads (costs/synthetic.py)."""
    from specpipe.costs import synthetic

    measured = range(1, prof.stage_layers)  # the slope of the middle stages (costs/measure.py)
    prof.model.update(name=ckpt.path.name, type_mix=ckpt.mix,
                      measured_layer_types=synthetic.type_counts(ckpt, measured),
                      **synthetic.weight_bytes(ckpt, ckpt.nbytes))
    prof.assumptions.insert(0, f"synthetic: random weights of {ckpt.path.name}'s shapes in {ckpt.mix}'s GGML types "
                               f"(costs/synthetic.py), built and timed like a real file's")


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

    from specpipe.config import LinkOptions
    from specpipe.costs.profile import Link
    from specpipe.engine.core import EngineCore
    from specpipe.engine.start_pipeline import local_processes
    from specpipe.loader import open_checkpoint
    from specpipe.loader.default_model import default_model_path
    from specpipe.loader.partition import partition_layers
    from specpipe.messages import Control
    from specpipe.request import Request
    from specpipe.sampling import SamplingParams
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
        core.observer = StepTracer(num_stages)
        core.run([Request(0, [1, 2, 3, 4], SamplingParams(max_tokens=max(8, steps // (4 * num_stages))), frozenset())],
                 on_finish=lambda _r: core.request_stage_stats())
        trace = core.observer.finish()
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


