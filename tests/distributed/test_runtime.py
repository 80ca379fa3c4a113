"""The multi-process runtime end to end, through the command line a user types.

  * S = 1, 2, 4 (in-process, and one process per stage on loopback) give the same tokens, greedy
    and with seeded sampling, and the same as all stages in one process; step accounting is exact.
  * The real default model (SmolLM2-135M) gives the same tokens at S = 2 as at S = 1.
  * A stage killed or stopped mid-generation, and Ctrl-C, end the run promptly with one clear line
    and leave no process behind.
  * Bad configuration is refused before any process starts.
  * Three "hosts" (Linux network namespaces joined by a bridge) run the torchrun-style entry point
    (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) and give the single-process tokens.

Every run is a subprocess with a hard timeout, in its own session, so that whatever happens the
test can find and end everything it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from netns_helpers import Hosts, NamespacesUnavailable
from proc_helpers import (Run, alive, clean_env, cmdline, descendants, kill_session,
                          stage_pids, wait_gone)

PROMPT = "the theatre in the sea"
TOKENS = 16
def generate(args: list[str], timeout_s: float = 120.0) -> dict:
    run = Run(["generate", *args])
    try:
        rc = run.wait(timeout_s)
        assert rc == 0, f"exit {rc}:\n{run.stderr}"
        return run.result()
    finally:
        kill_session(run.proc)


def error_lines(stderr: str) -> list[str]:
    """Stderr without progress lines and torch's C++ warnings."""
    return [line for line in stderr.splitlines()
            if line.strip() and " ready: " not in line and not line.startswith(("specpipe: KV cache:", "[W", "[I"))]


# -- S = 1, 2, 4 give the same tokens ----------------------------------------------------------------

GREEDY: list[str] = []
SEEDED = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]
CONFIGS = {
    # name: (extra args, S, runs in processes)
    "S1": (["--stages", "1"], 1, False),
    "S2": (["--stages", "2"], 2, True),
    "S2-layers-1,3": (["--stages", "2", "--stage-layers", "1,3"], 2, True),
    "S4": (["--stages", "4"], 4, True),
    "S4-inproc": (["--stages", "4", "--transport", "inproc"], 4, False),
}
SAMPLING = {"greedy": GREEDY, "seeded": SEEDED}
CASES = [(s, c) for s in SAMPLING for c in CONFIGS if not (s == "seeded" and c == "S2-layers-1,3")]


@pytest.fixture(scope="module")
def runs(tiny_llama_dir):
    """Each (sampling, config) generation, all started on first use, two at a time: most of a
    run is process start-up (importing torch), which two cores overlap well."""
    pool = ThreadPoolExecutor(max_workers=2)
    futures: dict[tuple[str, str], Future] = {}

    def get(sampling: str, config: str) -> dict:
        if not futures:
            for case in [("greedy", "S4-inproc"), ("seeded", "S4-inproc"), *CASES]:
                if case not in futures:
                    futures[case] = pool.submit(generate, [
                        "--model", str(tiny_llama_dir), "--no-chat", "--json", "--max-tokens", str(TOKENS),
                        *CONFIGS[case[1]][0], *SAMPLING[case[0]], PROMPT])
        return futures[sampling, config].result()

    yield get
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("sampling,config", CASES)
def test_stage_counts_give_identical_tokens(runs, sampling, config):
    reference = runs(sampling, "S4-inproc")  # every stage in this process: the reference pipeline
    out = runs(sampling, config)
    assert len(out["token_ids"]) == TOKENS and out["finish_reason"] == "length"
    assert out["token_ids"] == reference["token_ids"]
    assert out["text"] == reference["text"]
    if sampling == "seeded":
        assert out["stats"]["seed"] == 3


@pytest.mark.parametrize("sampling,config", CASES)
def test_pp_step_accounting(runs, sampling, config):
    _, S, processes = CONFIGS[config]
    stats = runs(sampling, config)["stats"]
    assert stats["mode"] == "pp" and stats["num_stages"] == S
    # Plain PP: every token, the first included, crosses all S stages: exactly S steps per token.
    assert stats["pipeline_steps"] == TOKENS * S
    assert stats["tokens_per_step"] == pytest.approx(1 / S)
    assert stats["hit_rate"] is None
    stages = stats["stages"]
    assert len(stages) == S
    # Stage-side steps of the request: its TOKENS*S steps and the step that delivers its release
    # (which also carries the stats report: no step of its own).
    assert [st["steps"] for st in stages] == [TOKENS * S + 1] * S
    for i, st in enumerate(stages):
        assert st["compute_s"] > 0 and st["compute_ms_per_step"] > 0
        assert st["wait_s"] >= 0 and st["wait_ms_per_step"] >= 0
        # Every stage computes the prompt and each token once: nothing speculative is wasted.
        assert st["rows_computed"] == st["rows_committed"] > 0
        if processes:
            # Hidden states (and control) cross every link; the last stage sends only token ids.
            assert st["bytes_sent"] > 0 and st["bytes_per_step"] > 0
            if i < S - 1:
                assert st["bytes_sent"] > stages[-1]["bytes_sent"]
        else:
            assert st["bytes_sent"] == 0


def test_seeded_sampling_differs_from_greedy(runs):
    # The seeded runs above really sample (otherwise their agreement would prove little).
    assert runs("seeded", "S4-inproc")["token_ids"] != runs("greedy", "S4-inproc")["token_ids"]


def test_default_model_two_stages_match_one():
    from specpipe.loader.default_model import DefaultModelMissing, default_model_path

    try:
        default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(f"the default model is not installed: {e}")
    args = ["--json", "--max-tokens", "8", "--quiet", "What is the capital of France?"]
    with ThreadPoolExecutor(max_workers=2) as pool:  # both at once: loading dominates
        one, two = pool.map(lambda extra: generate([*extra, *args], timeout_s=180),
                            [["--stages", "1"], ["--stages", "2"]])
    assert len(one["token_ids"]) >= 1
    assert two["token_ids"] == one["token_ids"]
    assert two["text"] == one["text"]
    assert two["stats"]["pipeline_steps"] == 2 * len(two["token_ids"])


# -- failures: a stage killed, a stage stopped, Ctrl-C ------------------------------------------------

@pytest.fixture(scope="module")
def long_model(tiny_model_dir) -> Path:
    """The tiny model with room for a long generation."""
    return tiny_model_dir("llama", max_position_embeddings=4096)


def start_long_run(model: Path, *extra: str) -> Run:
    """A 2-stage generation that runs for a minute or more unless something stops it (past the
    tiny model's end of sequence, which it reaches after some 170 tokens: a few seconds)."""
    run = Run(["generate", "--model", str(model), "--no-chat", "--json", "--max-tokens", "2000", "--max-context", "4096",
               "--ignore-eos", "--stages", "2", "--link-delay-ms", "5", *extra, PROMPT])
    run.wait_for_stderr(" ready: ", 2, timeout_s=90)  # both stages loaded
    time.sleep(2.0)  # mid-generation
    assert run.proc.poll() is None, run.stderr
    return run


def assert_clean_error(stderr: str, *needles: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, f"expected one error line, got:\n{stderr}"
    line = lines[0]
    assert line.startswith("specpipe: error: "), line
    for n in needles:
        assert n in line, line
    return line


def test_killed_stage_fails_fast_and_cleanly(long_model):
    run = start_long_run(long_model, "--restart-stages", "0")  # tests/distributed/test_restart.py: with restarts
    try:
        family = descendants(run.proc.pid)
        stages = stage_pids(run.proc.pid)
        assert len(stages) == 2, [cmdline(p) for p in family]
        killed_at = time.monotonic()
        os.kill(stages[1], signal.SIGKILL)  # stage 2, the last one
        rc = run.wait(30)
        elapsed = time.monotonic() - killed_at
        assert rc == 2, run.stderr
        # A dead process is seen at once (its sockets close), not after the 30 s stage timeout.
        assert elapsed < 15, elapsed
        assert_clean_error(run.stderr, "stage 2", "signal 9")
        assert wait_gone(family, 10) == [], [cmdline(p) for p in family if alive(p)]
    finally:
        kill_session(run.proc)


def test_stopped_stage_is_named_after_the_stage_timeout(long_model):
    run = start_long_run(long_model, "--stage-timeout", "5", "--restart-stages", "0")
    stopped = None
    try:
        family = descendants(run.proc.pid)
        stopped = stage_pids(run.proc.pid)[1]
        stopped_at = time.monotonic()
        os.kill(stopped, signal.SIGSTOP)  # a hung stage, or a link that stopped: only heartbeats tell
        rc = run.wait(30)
        elapsed = time.monotonic() - stopped_at
        assert rc == 2, run.stderr
        assert 4.5 < elapsed < 10, elapsed
        assert_clean_error(run.stderr, "stage 2", "stopped responding")
        assert wait_gone(family, 10) == [], [cmdline(p) for p in family if alive(p)]
    finally:
        if stopped is not None and alive(stopped):
            os.kill(stopped, signal.SIGKILL)
        kill_session(run.proc)


def test_ctrl_c_ends_everything(long_model):
    run = start_long_run(long_model)
    try:
        family = descendants(run.proc.pid)
        assert len(stage_pids(run.proc.pid)) == 2
        sent_at = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        rc = run.wait(15)
        assert rc == 130, run.stderr
        assert wait_gone(family, 5) == [], [cmdline(p) for p in family if alive(p)]
        assert time.monotonic() - sent_at < 8
        assert "Traceback" not in run.stderr, run.stderr
        assert error_lines(run.stderr) == ["specpipe: interrupted"], run.stderr
    finally:
        kill_session(run.proc)


# -- bad configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--stages", "0"], "--stages must be at least 1"),
    (["--stages", "5"], "more than the model's 4 layers"),
    (["--stages", "2", "--stage-layers", "1,2"], "sums to 3 but the model has 4 layers"),
    (["--mode", "fastest"], "unknown mode 'fastest'"),
])
def test_bad_configuration_is_refused_before_starting(tiny_llama_dir, args, message):
    run = Run(["generate", "--model", str(tiny_llama_dir), "--no-chat", *args, PROMPT])
    try:
        rc = run.wait(60)
        assert rc == 2, run.stderr
        assert_clean_error(run.stderr, message)
        assert run.out == ""
        assert " ready: " not in run.stderr  # no stage was started
    finally:
        kill_session(run.proc)


# -- three hosts: network namespaces -----------------------------------------------------------------

@pytest.fixture
def namespaces():
    """Three hosts (driver + 2 stages): network namespaces on one bridge (tests/netns_helpers.py),
    removed on teardown, failure included; skipped where namespaces cannot be made."""
    try:
        hosts = Hosts(3)
    except NamespacesUnavailable as e:
        pytest.skip(str(e))
    with hosts:
        yield hosts


def _three_hosts(namespaces, tiny_llama_dir, port: int, key_file: Path) -> list[Run]:
    """The driver and two stage ranks, each in its namespace, run to the end (stages started
    first: they wait for the driver's store); every rank holds the same key file."""
    procs: list[Run] = []
    try:
        for rank in (1, 2, 0):
            host = namespaces[rank]
            env = clean_env(RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR=namespaces[0].address,
                            MASTER_PORT=str(port))
            procs.append(Run(["generate", "--model", str(tiny_llama_dir), "--stages", "2", "--no-chat", "--json",
                              "--max-tokens", "12", "--link-delay-ms", "3", "--cluster-key-file", str(key_file), PROMPT],
                             env=env, cmd_prefix=host.cmd()))
        for run in procs:
            if run.wait(120) != 0:
                break  # the others would wait for it: they are stopped below
        return procs
    finally:
        for run in procs:
            kill_session(run.proc)


# Seen once in about twenty runs (2026-12-02, never reproduced on demand): a stage rank aborted
# at start inside its namespace with torch's "terminate called without an active exception" and
# no Python error before it. Such a start is tried once more; any other failure fails at once.
TORCH_START_ABORT = "terminate called without an active exception"


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_torchrun_rank_without_a_key_is_refused(tiny_llama_dir, rank):
    """Ranks of a torchrun job share no secret unless given one, and without it anyone who reaches
    the ports could join or alter the pipeline: each rank refuses to start, saying what to do."""
    proc = subprocess.run([sys.executable, "-m", "specpipe.entrypoints.cli", "generate", "--model",
                           str(tiny_llama_dir), "--stages", "2", "--max-tokens", "2", PROMPT],
                          env=clean_env(RANK=rank, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29410"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--cluster-key-file" in proc.stderr, proc.stderr[-2000:]


def test_three_hosts_over_network_namespaces(namespaces, runs, tiny_llama_dir, tmp_path):
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(os.urandom(32))
    procs = _three_hosts(namespaces, tiny_llama_dir, 29400, key_file)
    if any(r.proc.returncode == -6 and TORCH_START_ABORT in r.stderr for r in procs):
        procs = _three_hosts(namespaces, tiny_llama_dir, 29401, key_file)
    for run in procs:
        assert run.proc.returncode == 0, "\n---\n".join(r.stderr for r in procs)
    driver = procs[-1]
    out = driver.result()
    # Greedy: a 12-token run is the first 12 tokens of the 16-token single-process run.
    assert out["token_ids"] == runs("greedy", "S1")["token_ids"][:12]
    assert out["stats"]["pipeline_steps"] == 24
    assert len(out["stats"]["stages"]) == 2
    assert all(st["bytes_sent"] > 0 for st in out["stats"]["stages"])
    for stage in procs[:2]:
        assert stage.out == ""  # stages print nothing on stdout
        assert "Traceback" not in stage.stderr
