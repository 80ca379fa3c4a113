"""Prometheus metrics of a serving engine (`specpipe:` prefix, in the shape of vLLM's `vllm:`).

Request-level figures are observed on the engine thread as tokens are delivered (the Observer
hooks of AsyncEngine); levels (running and waiting requests, KV use, per-stage counters) are read
when /metrics is scraped, from the step loop's snapshot and the stages' last report (it rides on
ordinary steps, at most once a second: a scrape costs no step). Definitions as in
docs/design.md §9: TTFT from arrival to the first token, ITL per delivered chunk, TBT (time per output token)
per request after the first token.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specpipe.engine.async_engine import EngineSnapshot
from specpipe.request import Request

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0)
TOKENS_PER_STEP_BUCKETS = (0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0)


class EngineMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], healthy: Callable[[], bool],
                 model_name: str, registry: Optional[CollectorRegistry] = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": r}

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"specpipe:{name}", doc, buckets=buckets, **labels).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"specpipe:{name}", doc, **labels).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to the first output token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between a request's consecutive output chunks.",
                        LATENCY_BUCKETS)
        self.tbt = hist("request_time_per_output_token_seconds",
                        "Mean time between a request's output tokens after the first (TBT).", LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the end of a request.", REQUEST_BUCKETS)
        self.step_time = hist("pipeline_step_duration_seconds", "Driver time of one pipeline step.", LATENCY_BUCKETS)
        self.tokens_per_step = hist("request_tokens_per_step",
                                    "Output tokens per pipeline step of a finished request.", TOKENS_PER_STEP_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens delivered.")
        self.drafted = counter("spec_decode_num_draft_tokens", "Draft tokens sent into the pipeline (tree nodes).")
        self.verified = counter("spec_decode_num_verified_tokens",
                                "Target tokens checked against a speculative tree.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Verified tokens the tree held (hits).")
        self.draft_failures = counter("spec_decode_draft_kv_failures",
                                      "Times the draft model's KV pool ran out for a request (then recomputed).")
        self.stage_restarts = counter("request_stage_restarts",
                                      "Requests recomputed because the stages died and were started again.")
        self._success = Counter("specpipe:request_success", "Finished requests by finish reason.",
                                labelnames=["model_name", "finished_reason"], registry=r)
        self._model = model_name
        # Totals over finished requests, for the ratio gauges.
        self._out_tokens = self._out_steps = self._verified = self._accepted = 0
        self.stages: Optional[list[dict]] = None  # the latest stage report
        self.placement: list[dict] = []  # each stage's node, state and restarts (Engine.placement)
        self.kernels: Optional[dict] = None  # the kernel per weight type (Engine.kernel_report)
        self._stages_before: Optional[list[dict]] = None  # the one before (for step time)
        r.register(_LevelCollector(self, snapshot, healthy))

    # -- AsyncEngine's Observer ---------------------------------------------------------------------
    def on_admit(self, req: Request) -> None:
        self.prompt_tokens.inc(len(req.prompt_ids))

    def on_tokens(self, req: Request, n: int, gap_s: Optional[float]) -> None:
        self.generation_tokens.inc(n)
        if gap_s is None:
            self.ttft.observe(req.token_times[0] - req.arrival)
        else:
            self.itl.observe(gap_s)

    def on_finish(self, req: Request) -> None:
        s = req.stats
        self._success.labels(self._model, req.finish_reason or "length").inc()
        self.e2e.observe(time.perf_counter() - req.arrival)
        n = len(req.output_ids)
        if n > 1:
            self.tbt.observe((req.token_times[-1] - req.token_times[0]) / (n - 1))
        if s.pipeline_steps:
            self.tokens_per_step.observe(n / s.pipeline_steps)
            self._out_tokens += n
            self._out_steps += s.pipeline_steps
        self._verified += s.verifications
        self._accepted += s.hits
        self.drafted.inc(s.drafted)
        self.verified.inc(s.verifications)
        self.accepted.inc(s.hits)
        self.draft_failures.inc(s.draft_failures)
        self.stage_restarts.inc(s.stage_restarts)

    def on_step(self, seconds: float) -> None:
        self.step_time.observe(seconds)

    def set_stages(self, report: Optional[list[dict]]) -> None:
        if report is not None and report is not self.stages:
            self._stages_before, self.stages = self.stages, report


class _LevelCollector:
    """Levels read at scrape time: requests running and waiting, KV use, per-stage counters."""

    def __init__(self, m: EngineMetrics, snapshot: Callable[[], EngineSnapshot], healthy: Callable[[], bool]):
        self.m, self.snapshot, self.healthy = m, snapshot, healthy

    def collect(self) -> Iterator[Metric]:
        m, snap, model = self.m, self.snapshot(), [self.m._model]

        def gauge(name: str, doc: str, value: Optional[float]) -> Optional[Metric]:
            g = GaugeMetricFamily(f"specpipe:{name}", doc, labels=["model_name"])
            g.add_metric(model, float("nan") if value is None else value)
            return g

        yield gauge("engine_healthy", "1 while the pipeline serves, 0 after a stage failed.", float(self.healthy()))
        yield gauge("num_requests_running", "Requests in the pipeline.", snap.running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", snap.waiting)
        steps = CounterMetricFamily("specpipe:pipeline_steps", "Pipeline steps run.", labels=["model_name"])
        steps.add_metric(model, snap.steps)
        yield steps
        yield gauge("tokens_per_step", "Output tokens per pipeline step over all finished requests.",
                    m._out_tokens / m._out_steps if m._out_steps else None)
        yield gauge("spec_decode_hit_rate", "Accepted / verified tokens since the start.",
                    m._accepted / m._verified if m._verified else None)
        yield gauge("scheduler_kv_usage_perc", "Share of the KV pool the scheduler has given out (0-1).",
                    snap.kv_blocks_used / snap.kv_blocks if snap.kv_blocks else None)
        if snap.prefix_caching:
            for name, doc, value in (
                    ("prefix_cache_queries", "Prompt tokens of admitted requests looked up in the prefix cache.",
                     snap.prefix_cache_queries),
                    ("prefix_cache_hits", "Of those, tokens the cache held (not computed).", snap.prefix_cache_hits)):
                c = CounterMetricFamily(f"specpipe:{name}", doc, labels=["model_name"])
                c.add_metric(model, value)
                yield c
            yield gauge("prefix_cache_hit_rate", "Prefix cache hits / queries since the start (tokens).",
                        snap.prefix_cache_hits / snap.prefix_cache_queries if snap.prefix_cache_queries else None)
        yield from self._stages()

    def _kernels(self) -> Iterator[Metric]:
        k = self.m.kernels
        if not k:
            return
        info = GaugeMetricFamily("specpipe:kernel_info", "1 for each weight type: the kernel its matmuls run "
                                 "on (native, dequant = the portable torch kernel, float32) and the native "
                                 "library's ISA path (none when it is not in use), as the driver sees them.",
                                 labels=["model_name", "weight_type", "kernel", "isa"])
        for qtype, kernel in k["weights"].items():
            info.add_metric([self.m._model, qtype, kernel, k["native_isa"] or "none"], 1.0)
        yield info

    def _placement(self) -> Iterator[Metric]:
        m = self.m
        yield from self._kernels()
        if not m.placement:
            return
        info = GaugeMetricFamily("specpipe:stage_info", "1 for each stage: the node it runs on and its state "
                                 "(running or failed).", labels=["model_name", "stage", "node", "state"])
        restarts = CounterMetricFamily("specpipe:stage_restarts", "Times the stages were started again after "
                                       "one died (its requests recomputed).", labels=["model_name"])
        for st in m.placement:
            info.add_metric([m._model, str(st["stage"]), st["node"], st["state"]], 1.0)
        restarts.add_metric([m._model], m.placement[0]["restarts"])
        yield info
        yield restarts

    def _stages(self) -> Iterator[Metric]:
        m = self.m
        yield from self._placement()
        if not m.stages:
            return
        labels = ["model_name", "stage"]
        kv = GaugeMetricFamily("specpipe:kv_cache_usage_perc", "Share of a stage's KV blocks in use (0-1).",
                               labels=labels)
        blocks = GaugeMetricFamily("specpipe:kv_cache_blocks_in_use", "KV blocks a stage holds for requests.",
                                   labels=labels)
        window = GaugeMetricFamily("specpipe:kv_cache_window_blocks_in_use",
                                   "KV blocks a stage holds for requests in its sliding-window layers' own pool.",
                                   labels=labels)
        step_time = GaugeMetricFamily("specpipe:stage_step_time_seconds",
                                      "A stage's mean compute time per step between its last two reports.",
                                      labels=labels)
        memory = {k: GaugeMetricFamily(f"specpipe:stage_{k}", doc, labels=labels) for k, doc in (
            ("weight_bytes", "Bytes of a stage's weights as held (quantized blocks stay packed)."),
            ("kv_cache_bytes", "Bytes of a stage's KV cache."),
            ("resident_memory_bytes", "Resident memory of the process running a stage (in-process stages "
                                      "share one process)."))}
        counters = {k: CounterMetricFamily(f"specpipe:stage_{k}", doc, labels=labels) for k, doc in (
            ("steps", "Steps a stage ran."), ("compute_seconds", "Time a stage spent in forward passes."),
            ("wait_seconds", "Time a stage waited for its input."),
            ("rows_computed", "Rows a stage computed."), ("rows_committed", "Computed rows that were committed."))}
        before = m._stages_before or [{}] * len(m.stages)
        for i, (st, b) in enumerate(zip(m.stages, before), 1):
            lab = [m._model, str(i)]
            kv.add_metric(lab, st["blocks_in_use"] / st["num_blocks"] if st["num_blocks"] else 0.0)
            blocks.add_metric(lab, st["blocks_in_use"])
            window.add_metric(lab, st.get("window_blocks_in_use", 0))
            d_steps = st["steps"] - b.get("steps", 0)
            step_time.add_metric(lab, (st["compute_s"] - b.get("compute_s", 0.0)) / d_steps if d_steps else 0.0)
            for k, fam in memory.items():
                fam.add_metric(lab, st[{"kv_cache_bytes": "kv_bytes", "resident_memory_bytes": "rss_bytes"}.get(k, k)])
            for k, fam in counters.items():
                fam.add_metric(lab, st[{"compute_seconds": "compute_s", "wait_seconds": "wait_s"}.get(k, k)])
        yield kv
        yield blocks
        yield window
        yield step_time
        yield from memory.values()
        yield from counters.values()
