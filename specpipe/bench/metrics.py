"""What one serving-benchmark request measured, and the pure functions that turn many of them into
the reported figures (aggregate) and into text (summary block, Markdown table).

Glossary (all latencies are measured on the client, from sending the request):
  TTFT   time to the first non-empty content chunk
  ITL    inter-token latency: each gap between two consecutive content chunks (a chunk may carry
         several tokens, e.g. when a speculative server commits a few at once)
  TBT    time between tokens of one request, the first excluded: (E2E - TTFT) / (output tokens - 1);
         vLLM calls it TPOT
  E2E    end-to-end latency: until the stream's end
  goodput  completed requests per second that met every given SLO
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

LATENCIES = (("ttft", "TTFT", "Time to First Token"), ("tbt", "TBT", "Time between Tokens (TPOT)"),
             ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2E", "End-to-end Latency"))
SLO_NAMES = {"ttft": "ttft", "tbt": "tbt", "tpot": "tbt", "e2el": "e2el"}  # --goodput key -> metric
MAX_ERRORS_REPORTED = 5


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds."""
    index: int                      # position in the prompt list
    group: str | None = None        # Spec-Bench group, if any
    success: bool = False
    error: str | None = None
    prompt_tokens: int | None = None  # from the server's usage; None if it sent none
    output_tokens: int = 0          # usage's completion_tokens, else the number of content chunks
    usage_reported: bool = False
    send_time: float = 0.0          # when it was sent, after the run's start
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2el: float | None = None
    text: str = ""
    disconnected: bool = False      # the client left on purpose (--disconnect-fraction): not a failure

    @property
    def tbt(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_json(self, with_text: bool = False) -> dict:
        out = {"index": self.index, "group": self.group, "success": self.success, "error": self.error,
               "disconnected": self.disconnected,
               "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
               "usage_reported": self.usage_reported, "send_time_s": round(self.send_time, 6),
               "ttft_ms": _ms(self.ttft), "tbt_ms": _ms(self.tbt), "e2el_ms": _ms(self.e2el),
               "itl_ms": [_ms(g) for g in self.itl]}
        if with_text:
            out["text"] = self.text
        return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default rule)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def pct_key(p: float) -> str:
    return f"p{p:g}"


def meets_slos(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request met every SLO; a request with one output token has no TBT and
    meets a TBT SLO."""
    values = {"ttft": r.ttft, "tbt": r.tbt, "e2el": r.e2el}
    return all(values[SLO_NAMES[k]] is None or values[SLO_NAMES[k]] * 1000 <= limit
               for k, limit in slos_ms.items())


def aggregate(records: list[RequestRecord], duration: float, percentiles: list[float],
              slos_ms: dict[str, float] | None = None) -> dict:
    """The figures of one run. Latency statistics are over completed requests only (ITL over every
    gap of every completed request); throughputs divide by the run's wall time `duration`."""
    ok = [r for r in records if r.success and not r.disconnected]
    left = sum(r.disconnected for r in records)

    def per_s(x: float) -> float | None:
        return x / duration if duration > 0 else None

    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    reported = {r.usage_reported for r in ok}
    m = {"completed": len(ok), "failed": len(records) - len(ok) - left, "disconnected": left, "duration_s": duration,
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         # "chunks": the server sent no usage, so output tokens are content chunks and input unknown
         "output_tokens_source": None if not ok else "usage" if reported == {True}
         else "chunks" if reported == {False} else "mixed",
         "request_throughput": per_s(len(ok)), "output_throughput": per_s(out_tokens),
         "total_token_throughput": per_s(in_tokens + out_tokens)}
    samples = {"ttft": [r.ttft for r in ok], "tbt": [r.tbt for r in ok if r.tbt is not None],
               "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    for name, values in samples.items():
        ms = [v * 1000 for v in values]
        m[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else None
        for p in percentiles:
            m[f"{pct_key(p)}_{name}_ms"] = percentile(ms, p) if ms else None
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        m["goodput_requests"] = good
        m["request_goodput"] = per_s(good)
    errors = [r.error for r in records if not r.success]
    m["errors"] = list(dict.fromkeys(errors))[:MAX_ERRORS_REPORTED]  # the first few distinct ones
    return m


def rate_json(rate: float) -> float | str:
    """A request rate as stored in the results: strict JSON has no Infinity, so "inf"."""
    return "inf" if math.isinf(rate) else rate


def format_rate(rate: float | str) -> str:
    return "inf" if rate == "inf" or math.isinf(rate) else f"{rate:g}"


def _num(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_summary(run: dict, percentiles: list[float], label: str | None = None) -> str:
    """A vLLM-like result block for one run."""
    width = 50

    def line(name: str, value) -> str:
        return f"{name:<40}{value:>10}"

    out = [" Serving Benchmark Result ".center(width, "=")]
    if label:
        out.append(line("Label:", label))
    out += [line("Request rate (req/s):", format_rate(run["request_rate"])),
            line("Burstiness:", f"{run['burstiness']:g}"),
            line("Max concurrency:", str(run["max_concurrency"] or "-")),
            line("Successful requests:", run["completed"]),
            line("Failed requests:", run["failed"]),
            *([line("Disconnected on purpose:", run["disconnected"])] if run.get("disconnected") else []),
            line("Benchmark duration (s):", _num(run["duration_s"])),
            line("Total input tokens:", run["total_input_tokens"]),
            line("Total generated tokens:", run["total_output_tokens"]),
            line("Request throughput (req/s):", _num(run["request_throughput"])),
            line("Output token throughput (tok/s):", _num(run["output_throughput"])),
            line("Total token throughput (tok/s):", _num(run["total_token_throughput"]))]
    if "request_goodput" in run:
        out.append(line("Request goodput (req/s):", _num(run["request_goodput"])))
    if run["output_tokens_source"] in ("chunks", "mixed"):
        out.append("(no usage from the server: output tokens counted as content chunks)")
    for key, short, title in LATENCIES:
        out.append(f" {title} ".center(width, "-"))
        out.append(line(f"Mean {short} (ms):", _num(run[f"mean_{key}_ms"])))
        out += [line(f"P{p:g} {short} (ms):", _num(run[f"{pct_key(p)}_{key}_ms"])) for p in percentiles]
    out += [f"error: {error}" for error in run["errors"]]
    out.append("=" * width)
    return "\n".join(out)


def format_markdown(results: list[dict], command: str) -> str:
    """One Markdown table, a row per (result set, rate), the command line above it. Each result set
    is what serve.benchmark returns: {"label", "percentiles", "runs", ...}; all share percentiles."""
    percentiles = results[0]["percentiles"]
    with_goodput = any("request_goodput" in run for res in results for run in res["runs"])
    head = ["label", "rate (req/s)", "max conc", "ok", "failed", "duration (s)", "req/s", "out tok/s",
            "total tok/s"]
    for _, short, _ in LATENCIES:
        head += [f"{short} mean"] + [f"{short} {pct_key(p)}" for p in percentiles]
    if with_goodput:
        head.append("goodput (req/s)")
    rows = []
    for res in results:
        for run in res["runs"]:
            row = [res.get("label") or "-", format_rate(run["request_rate"]), str(run["max_concurrency"] or "-"),
                   str(run["completed"]), str(run["failed"]), _num(run["duration_s"]),
                   _num(run["request_throughput"]), _num(run["output_throughput"], ".1f"),
                   _num(run["total_token_throughput"], ".1f")]
            for key, _, _ in LATENCIES:
                row += [_num(run[f"mean_{key}_ms"], ".1f")]
                row += [_num(run[f"{pct_key(p)}_{key}_ms"], ".1f") for p in percentiles]
            if with_goodput:
                row.append(_num(run.get("request_goodput")))
            rows.append(row)
    table = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    return f"Command: `{command}`\n\nLatencies in ms.\n\n" + "\n".join(table) + "\n"
