#!/usr/bin/env python3
"""What the per-frame MAC on every link costs a pipeline step, and what --link-encryption costs
(distributed/channel.py).

Two measurements, one run:
1. A real pipeline (local stage processes, `pp`, one request, greedy, --ignore-eos): its time
   per pipeline step, the bytes each rank sent per step (the stages' reports, the driver's
   transport) and so the frames a step carries.
2. The MAC itself on this machine: `Sealer.mac` timed on an empty frame (the fixed cost: one
   HMAC-SHA256 set-up) and on a 64 KiB body (the cost per byte), median of --rounds; the same for
   `Cipher.seal` (AES-256-GCM, --link-encryption).

Cost per step = 2 (sealed by the sender, checked by the receiver) x (frames x fixed + bytes x
per-byte), all of it counted as if it were on the critical path (some of it overlaps other
stages' compute, so this is an upper bound). The issue's goal: under 3% of a step on the Qwen
1.5B S = 2 pipeline. With --encrypted-run, the pipeline also runs with --link-encryption and both
step times are printed (a direct A/B of encryption on top of the MAC; machine noise applies).

    python benchmarks/bench_link_mac.py --model TARGET.gguf [--stages 2] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from specpipe.config import EngineConfig  # noqa: E402
from specpipe.distributed.channel import Cipher, Sealer  # noqa: E402
from specpipe.engine.engine import Engine  # noqa: E402
from specpipe.sampling import SamplingParams  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def frame_costs(rounds: int, encrypt: bool = False) -> tuple[float, float]:
    """(seconds per frame, seconds per byte) of sealing a frame (Sealer.mac, or Cipher.seal when
    `encrypt`), medians over `rounds`."""
    header, body = b"\0" * 20, os.urandom(64 << 10)
    seal = Cipher(os.urandom(32)).seal if encrypt else Sealer(os.urandom(32)).mac
    fixed, per_kib = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(2000):
            seal(header, b"")
        t1 = time.perf_counter()
        for _ in range(200):
            seal(header, body)
        t2 = time.perf_counter()
        fixed.append((t1 - t0) / 2000)
        per_kib.append(((t2 - t1) / 200 - fixed[-1]) / len(body))
    return statistics.median(fixed), statistics.median(per_kib)


def pipeline_step(model: str, stages: int, tokens: int, encrypt: bool = False) -> dict:
    engine = Engine(EngineConfig(model=model, stages=stages, transport="processes", mode="pp", restart_stages=0,
                                 link_encryption=encrypt))
    try:
        out = engine.generate(PROMPT, SamplingParams(max_tokens=tokens), ignore_eos=True)
        st = out.stats
        steps = st["pipeline_steps"]
        driver_bytes = engine.pipeline.t.bytes_sent
        stage_bytes = [s["bytes_sent"] for s in st["stages"]]
        # Frames a step: the driver's control to every stage, its rows (header + tensor) to stage 1,
        # each stage's rows (header + tensor) to the next, the last stage's results.
        frames = stages + 2 + 2 * (stages - 1) + 1
        return {"step_ms": st["tbt_ms"] * st["tokens_per_step"], "tbt_ms": st["tbt_ms"], "steps": steps,
                "bytes_per_step": (driver_bytes + sum(stage_bytes)) / steps, "frames_per_step": frames}
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--encrypted-run", action="store_true", help="also run the pipeline with --link-encryption")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()
    fixed, per_byte = frame_costs(a.rounds)
    enc_fixed, enc_per_byte = frame_costs(a.rounds, encrypt=True)
    runs, encrypted = [], []
    for _ in range(a.repeats):  # alternating, so both see the same spells of noise
        runs.append(pipeline_step(a.model, a.stages, a.tokens))
        if a.encrypted_run:
            encrypted.append(pipeline_step(a.model, a.stages, a.tokens, encrypt=True))
    step_ms = statistics.median(r["step_ms"] for r in runs)
    r = runs[0]
    mac_ms = 2 * (r["frames_per_step"] * fixed + r["bytes_per_step"] * per_byte) * 1e3
    enc_ms = 2 * (r["frames_per_step"] * enc_fixed + r["bytes_per_step"] * enc_per_byte) * 1e3
    result = {"machine": platform.processor() or platform.machine(), "cpu_model": _cpu_model(),
              "method": "real run (step) + measured MAC cost over that step's frames",
              "model": os.path.basename(a.model), "stages": a.stages, "tokens": a.tokens,
              "step_ms_median": step_ms, "step_ms_runs": [x["step_ms"] for x in runs],
              "frames_per_step": r["frames_per_step"], "bytes_per_step": r["bytes_per_step"],
              "mac_us_per_frame": fixed * 1e6, "mac_gb_per_s": 1e-9 / per_byte if per_byte > 0 else None,
              "mac_ms_per_step": mac_ms, "mac_share_of_step": mac_ms / step_ms,
              "aes_gcm_us_per_frame": enc_fixed * 1e6, "aes_gcm_gb_per_s": 1e-9 / enc_per_byte if enc_per_byte > 0 else None,
              "encryption_ms_per_step": enc_ms, "encryption_share_of_step": enc_ms / step_ms}
    if encrypted:
        result["encrypted_step_ms_median"] = statistics.median(x["step_ms"] for x in encrypted)
        result["encrypted_step_ms_runs"] = [x["step_ms"] for x in encrypted]
    print(json.dumps(result, indent=1))
    print(f"MAC per step {mac_ms * 1e3:.1f} us of a {step_ms:.1f} ms step: {100 * mac_ms / step_ms:.3f}% "
          f"({r['frames_per_step']} frames, {r['bytes_per_step']:.0f} B a step; goal < 3%); AES-GCM in its place "
          f"{enc_ms * 1e3:.1f} us ({100 * enc_ms / step_ms:.3f}%)", file=sys.stderr)
    if encrypted:
        print(f"real steps: {step_ms:.1f} ms authenticated, {result['encrypted_step_ms_median']:.1f} ms encrypted "
              f"(medians of {a.repeats}, alternating)", file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
