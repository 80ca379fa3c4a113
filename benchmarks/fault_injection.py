#!/usr/bin/env python3
"""Fault injection: kill or stop a random stage process at a random step while several requests
stream, and count how many trials still end with every request's exact undisturbed tokens.

Method (a real run on this machine's CPU): the undisturbed tokens come from the same requests
served in one process. Each trial then serves the requests together through one engine with
local stage processes (--restart-stages on), and at a random step in [2, --max-step] sends
SIGKILL or SIGSTOP to a random stage. A killed stage is noticed at once (its links close); a
stopped one after --stage-timeout. The engine starts the stages again and recomputes the
requests in flight; the trial counts as identical when every request's tokens equal the
undisturbed ones. Reported per trial: signal, stage, step, seconds from the fault to the last
token, and whether the tokens were identical.

Usage:
  python benchmarks/fault_injection.py [--model DIR_OR_GGUF] [--stages 2] [--trials 6]
        [--signals kill,stop] [--requests 4] [--max-tokens 32] [--stage-timeout 5] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time

from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine
from specpipe.engine.restart import HEALTHY_STEPS
from specpipe.sampling import SamplingParams

PROMPTS = ["the theatre in the sea", "a b c a b c a b", "one two three four", "once upon a time",
           "hello there", "2 + 2 =", "the cat sat on the mat", "x y z"]
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def stage_pids() -> list[int]:
    """This process's stage children, oldest (rank 1) first."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid()), "--sort=start_time"],
                         capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "specpipe.worker.stage_main" in line]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--signals", default="kill,stop")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-step", type=int, default=12)
    p.add_argument("--stage-timeout", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rng = random.Random(a.seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(a.requests)]
    # Half greedy, half sampled with a seed: both must continue exactly after a restart.
    params = [SamplingParams(max_tokens=a.max_tokens, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
              for i in range(a.requests)]
    base = dict(model=a.model, mode="specpipe-db", draft="ngram", tree_width=4, kv_memory="64MiB",
                max_context=256, stages=a.stages)
    ref_engine = Engine(EngineConfig(**base, transport="inproc"))
    want = [ref_engine.generate(pr, sp, chat=False).token_ids for pr, sp in zip(prompts, params)]
    ref_engine.close()

    engine = Engine(EngineConfig(**base, stage_timeout_s=a.stage_timeout, restart_stages=a.trials + 1,
                                 stage_threads=1))
    trials = []
    try:
        for t in range(a.trials):
            sig = rng.choice(a.signals.split(","))
            stage, at = rng.randint(1, a.stages), rng.randint(2, a.max_step)
            core = engine.core()
            reqs = [engine.prompts.make_request(pr, sp, chat=False) for pr, sp in zip(prompts, params)]
            for r in reqs:
                core.add_request(r)
            steps, fault_at = 0, None
            while core.has_work():
                core.step()
                steps += 1
                if steps == at:
                    os.kill(stage_pids()[stage - 1], SIGNALS[sig])
                    fault_at = time.monotonic()
            trials.append({"trial": t, "signal": sig, "stage": stage, "step": at, "injected": fault_at is not None,
                           "recovery_s": round(time.monotonic() - fault_at, 2) if fault_at else None,
                           "identical": [r.output_ids for r in reqs] == want,
                           "finish": sorted({r.finish_reason for r in reqs})})
            if not a.json:
                print(json.dumps(trials[-1]), flush=True)
            # Faults less than HEALTHY_STEPS steps apart count as restarts in a row, each waiting
            # twice as long as the last (engine/restart.py); space the trials so that each is a
            # first fault, as independent faults in a server are.
            spacer = SamplingParams(max_tokens=HEALTHY_STEPS // a.stages + 8)  # pp: S steps a token
            engine.run([engine.prompts.make_request(PROMPTS[0], spacer, chat=False, ignore_eos=True)],
                       engine.core("pp"))
    finally:
        engine.close()
    summary = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}",
               "method": "real run: stage processes on this machine, tokens compared with an in-process run",
               "stages": a.stages, "requests": a.requests, "max_tokens": a.max_tokens,
               "trials": len(trials), "injected": sum(t["injected"] for t in trials),
               "identical": sum(t["identical"] for t in trials),
               "stage_restarts": engine.core().stage_restarts}
    print(json.dumps({"summary": summary, "trials": trials} if a.json else summary))


if __name__ == "__main__":
    main()
