#!/usr/bin/env python3
"""Fault injection: kill or stop a random stage process at a random step while several requests
stream, and count how many trials still end with every request's exact undisturbed tokens (with
stage restarts) or with an error naming the stage in time (--restart-stages 0).

Method (a real run on this machine's CPU): each trial serves the requests together through an
engine with local stage processes, and at a random step in [2, --max-step] sends SIGKILL or
SIGSTOP to a random stage. A killed stage is noticed at once (its links close); a stopped one
after --stage-timeout.

With restarts (the default): one engine serves every trial. It starts the stages again and
recomputes the requests in flight; the trial counts as identical when every request's tokens
equal those of the same requests served in one process. After each trial the driver and every
stage report their KV blocks in use (all 0 when nothing leaked).

With --restart-stages 0: each trial has an engine of its own (the pipeline is dead after the
fault). A trial passes when every request still running at the fault ended with an error that
names the faulted stage ("stage 2") within --stage-timeout + 5 s of the fault.

Both: after the trial (with --restart-stages 0, after engine.close()) no stage process it
replaced or closed may be left (a child, a zombie, or adopted by init), no child may be a zombie
or stopped, and exactly the stages in use (S, or 0) are running. Reported per trial: signal,
stage, step, seconds from the fault to the last request's end, the outcome, orphans and KV.

Usage:
  python benchmarks/fault_injection.py [--model DIR_OR_GGUF] [--stages 2] [--trials 6]
        [--signals kill,stop] [--requests 4] [--max-tokens 32] [--stage-timeout 5] [--seed 0]
        [--restart-stages N (default trials + 1; 0: no restarts)] [--json]
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
from specpipe.distributed.remote_pipeline import PipelineError
from specpipe.engine.engine import Engine
from specpipe.engine.restart import HEALTHY_STEPS
from specpipe.sampling import SamplingParams

PROMPTS = ["the theatre in the sea", "a b c a b c a b", "one two three four", "once upon a time",
           "hello there", "2 + 2 =", "the cat sat on the mat", "x y z"]
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def children() -> list[tuple[int, str, str]]:
    """This process's children as (pid, ps state, command line), oldest first."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "--ppid", str(os.getpid()), "--sort=start_time"],
                         capture_output=True, text=True).stdout
    return [(int(pid), stat, args) for pid, stat, args in (line.split(None, 2) for line in out.splitlines())]


def stage_pids() -> list[int]:
    """This process's stage children, oldest (rank 1) first."""
    return [pid for pid, _, args in children() if "specpipe.worker.stage_main" in args]


def orphans(replaced: list[int], live: int) -> list[str]:
    """What a trial left behind: a stage process it replaced or closed that still exists, a child
    that is a zombie or stopped, or a number of running stage children other than `live`."""
    kids = children()
    bad = {pid: f"{pid} state {stat}" for pid, stat, _ in kids if stat[0] in "TZ"}
    bad.update({pid: f"{pid} still exists" for pid in replaced if pid not in bad and os.path.exists(f"/proc/{pid}")})
    running = [pid for pid, _, args in kids if "specpipe.worker.stage_main" in args and pid not in bad]
    return list(bad.values()) + ([f"{len(running)} stage processes running, expected {live}"]
                                 if len(running) != live else [])


def driver_kv(core) -> int:
    """KV blocks the driver counts as held, in every pool (the sliding-window one included)."""
    return sum(pool.num_blocks - pool.num_free() for pool in core.scheduler.blocks.pools())


def kv_in_use(core) -> dict:
    """KV blocks still held: the driver's count, and each stage's own report (one step that only
    carries the request for it)."""
    core.request_stage_stats()
    core.step()
    return {"driver": driver_kv(core),
            "stages": [s["blocks_in_use"] + s.get("window_blocks_in_use", 0) for s in core.stage_stats]}


def serve(core, reqs, at: int, stage: int, sig: str) -> tuple[float | None, list[int], list]:
    """Serve `reqs`, sending `sig` to `stage` after step `at`. Returns when the fault was sent, the
    stage pids then, and the requests still running then. A pipeline that cannot go on ends every
    request with its error, as the server does (AsyncEngine._die)."""
    for r in reqs:
        core.add_request(r)
    steps, fault_at, pids, running = 0, None, [], []
    try:
        while core.has_work():
            core.step()
            steps += 1
            if steps == at:
                pids = stage_pids()
                os.kill(pids[stage - 1], SIGNALS[sig])
                fault_at = time.monotonic()
                running = [r for r in reqs if not r.finished]
    except PipelineError as e:
        for rid in list(core.requests):
            core.abort(rid, "error", str(e))
    return fault_at, pids, running


def no_restart_trial(base: dict, a, prompts, params, sig: str, stage: int, at: int) -> dict:
    """One trial with --restart-stages 0 on an engine of its own."""
    engine = Engine(EngineConfig(**base, stage_timeout_s=a.stage_timeout, restart_stages=0, stage_threads=1))
    try:
        core = engine.core()
        reqs = [engine.prompts.make_request(pr, sp, chat=False) for pr, sp in zip(prompts, params)]
        fault_at, pids, running = serve(core, reqs, at, stage, sig)
        took = round(time.monotonic() - fault_at, 2) if fault_at else None
        held = driver_kv(core)
    finally:
        t0 = time.monotonic()
        engine.close()
    # Requests that ended before the fault need no error; every other one must name the stage.
    named = sum(r.finish_reason == "error" and f"stage {stage} " in (r.error or "") for r in running)
    return {"signal": sig, "stage": stage, "step": at, "injected": fault_at is not None,
            "fault_to_end_s": took, "running": len(running), "named_stage": named,
            "finish": sorted({r.finish_reason for r in reqs}), "errors": sorted({r.error for r in reqs if r.error}),
            "pass": fault_at is not None and named == len(running) and took <= a.stage_timeout + 5,
            "close_s": round(time.monotonic() - t0, 2),
            "orphans": orphans(pids, 0), "kv_in_use": {"driver": held}}


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
    p.add_argument("--restart-stages", type=int, default=None,
                   help="restarts in a row the engine may make (default: trials + 1); 0: none, each "
                        "trial checks that every request ends with an error naming the stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    restarts = a.trials + 1 if a.restart_stages is None else a.restart_stages
    rng = random.Random(a.seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(a.requests)]
    # Half greedy, half sampled with a seed: both must continue exactly after a restart.
    params = [SamplingParams(max_tokens=a.max_tokens, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
              for i in range(a.requests)]
    base = dict(model=a.model, mode="specpipe-db", draft="ngram", tree_width=4, kv_memory="64MiB",
                max_context=256, stages=a.stages)
    trials = []

    def report(trial: dict) -> None:
        trials.append({"trial": len(trials), **trial})
        if not a.json:
            print(json.dumps(trials[-1]), flush=True)

    def draw() -> tuple[str, int, int]:
        return rng.choice(a.signals.split(",")), rng.randint(1, a.stages), rng.randint(2, a.max_step)

    if restarts == 0:
        for _ in range(a.trials):
            report(no_restart_trial(base, a, prompts, params, *draw()))
        summary = {"passed": sum(t["pass"] for t in trials),
                   "max_fault_to_end_s": max((t["fault_to_end_s"] or 0 for t in trials), default=None)}
    else:
        ref_engine = Engine(EngineConfig(**base, transport="inproc"))
        want = [ref_engine.generate(pr, sp, chat=False).token_ids for pr, sp in zip(prompts, params)]
        ref_engine.close()

        engine = Engine(EngineConfig(**base, stage_timeout_s=a.stage_timeout, restart_stages=restarts,
                                     stage_threads=1))
        try:
            for _ in range(a.trials):
                sig, stage, at = draw()
                core = engine.core()
                reqs = [engine.prompts.make_request(pr, sp, chat=False) for pr, sp in zip(prompts, params)]
                fault_at, pids, _ = serve(core, reqs, at, stage, sig)
                report({"signal": sig, "stage": stage, "step": at, "injected": fault_at is not None,
                        "recovery_s": round(time.monotonic() - fault_at, 2) if fault_at else None,
                        "identical": [r.output_ids for r in reqs] == want,
                        "finish": sorted({r.finish_reason for r in reqs}),
                        "orphans": orphans(pids, a.stages), "kv_in_use": kv_in_use(core)})
                # Faults less than HEALTHY_STEPS steps apart count as restarts in a row, each waiting
                # twice as long as the last (engine/restart.py); space the trials so that each is a
                # first fault, as independent faults in a server are.
                spacer = SamplingParams(max_tokens=HEALTHY_STEPS // a.stages + 8)  # pp: S steps a token
                engine.run([engine.prompts.make_request(PROMPTS[0], spacer, chat=False, ignore_eos=True)],
                           engine.core("pp"))
        finally:
            engine.close()
        summary = {"identical": sum(t["identical"] for t in trials),
                   "kv_zero": sum(not t["kv_in_use"]["driver"] and not any(t["kv_in_use"]["stages"])
                                  for t in trials),
                   "stage_restarts": engine.core().stage_restarts}
    summary = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}",
               "method": "real run: stage processes on this machine"
                         + (", tokens compared with an in-process run" if restarts else ", no restarts"),
               "load_average": [round(x, 1) for x in os.getloadavg()],
               "stages": a.stages, "requests": a.requests, "max_tokens": a.max_tokens, "restart_stages": restarts,
               "trials": len(trials), "injected": sum(t["injected"] for t in trials), **summary,
               "orphans": sum(len(t["orphans"]) for t in trials)}
    print(json.dumps({"summary": summary, "trials": trials} if a.json else summary))


if __name__ == "__main__":
    main()
