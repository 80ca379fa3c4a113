"""`specpipe bench`, `specpipe profile` and `specpipe sim` end to end on a tiny model."""

from __future__ import annotations

import json

import pytest

from specpipe.bench.offline import parse_runs
from specpipe.costs.profile import CostProfile
from specpipe.entrypoints.cli import main
from specpipe.sim.events import has_stage_spans
from specpipe.sim.trace import Trace

PROMPTS = ["the cat sat on the mat the cat sat on the", "one two three one two three one two", "abc abc abc abc"]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def bench(capsys, model, prompts, tmp_path, *extra) -> dict:
    code = main(["bench", "--model", str(model), "--dataset", str(prompts), "--max-tokens", "10",
                 "--result-json", str(tmp_path / "r.json"), "--result-md", str(tmp_path / "r.md"),
                 "--no-progress", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads((tmp_path / "r.json").read_text())


def test_oracle_step_counts_traces_and_pictures(capsys, tiny_llama_dir, prompts, tmp_path):
    """Every mode against oracle stages (outputs checked against the target's own), a trace per
    run that the simulator and the pictures read, and a profile measured on this CPU."""
    code = main(["profile", "--model", str(tiny_llama_dir), "--rows", "1,8", "--contexts", "16,64", "--repeats", "1",
                 "--probe-links", "2", "--threads", "1", "--stage-layers", "2,4", "--out", str(tmp_path / "p.json")])
    assert code == 0
    profile = CostProfile.load(tmp_path / "p.json")
    assert profile.method == "measured" and profile.num_layers == 4
    # A layer measured on middle stages of 2 and of all 4 layers, for each context and row count.
    assert profile.stage_layers == 2 and list(profile.layer_ms_by_stage) == ["4"]
    assert [len(r) for r in profile.layer_ms_by_stage["4"]] == [2, 2]
    # The link between two local stage processes, idle and while they compute: a message costs time.
    assert set(profile.links) == {"loopback-s2", "loopback-s2-busy"}
    assert all(link["latency_ms"] > 0 for link in profile.links.values())
    assert (profile.rows, profile.contexts, len(profile.request_ms)) == ([1, 8], [16, 64], 2)
    # A 1-layer stage costs something (a layer alone of this tiny model can drown in timing
    # noise, and is then taken as 0 with the stage's overhead holding the time).
    assert profile.stage(1, False, 8, 16) > 0
    report = bench(capsys, tiny_llama_dir, prompts, tmp_path, "--oracle", "--stages", "1,4",
                   "--runs", "pp,tree:depth=3,specpipe,specpipe:layers=2,specpipe-db", "--concurrency", "1",
                   "--trace-dir", str(tmp_path / "traces"), "--plots", str(tmp_path / "img"),
                   "--profile", str(tmp_path / "p.json"))
    assert report["method"].startswith("step count")
    runs = {(r["label"], r["stages"]): r for r in report["runs"]}
    assert len(runs) == 10
    pp = runs[("pp", 4)]["all"]
    tokens = pp["tokens"]  # up to 10 a prompt (the random model may end one early)
    assert 3 <= tokens <= 30 and pp["tokens_per_step"] == pytest.approx(0.25)  # S steps a token
    for (label, S), r in runs.items():
        assert r["all"]["tokens"] == tokens and r["all"]["ttft_ms_median"] is None  # no wall clock here
        trace = Trace.load(r["trace"])
        assert trace.num_stages == S and trace.meta["label"] == label and not trace.meta["real"]
        assert sum(s.rows[0] for s in trace.steps) >= tokens
    spec = runs[("specpipe", 4)]["all"]
    assert spec["speedup_vs_pp"] == pytest.approx(spec["tokens_per_step"] / pp["tokens_per_step"])
    assert runs[("tree depth=3", 4)]["all"]["acceptance_length"] >= 1.0
    assert "**all**" in (tmp_path / "r.md").read_text()
    assert {p.name for p in (tmp_path / "img").iterdir()} >= {"timeline_s1.png", "timeline_s4.png",
                                                              "tokens_per_step.png"}
    code = main(["sim", "--trace", *(str(tmp_path / "traces" / f) for f in ("trace_pp_s4.json", "trace_specpipe_s4.json")),
                 "--profile", str(tmp_path / "p.json"), "--link", "ib-100g", "--json", str(tmp_path / "s.json")])
    assert code == 0
    sims = json.loads((tmp_path / "s.json").read_text())
    assert [s["meta"]["mode"] for s in sims] == ["pp", "specpipe"]
    assert all(s["simulated"]["tbt_ms_median"] > 0 for s in sims)


def test_real_run_reports_wall_clock(capsys, tiny_llama_dir, prompts, tmp_path):
    report = bench(capsys, tiny_llama_dir, prompts, tmp_path, "--stages", "1", "--runs", "pp,specpipe",
                   "--concurrency", "3", "--trace-dir", str(tmp_path / "traces"))
    assert report["method"] == "real run"
    for r in report["runs"]:
        m = r["all"]
        assert m["tokens"] == report["runs"][0]["all"]["tokens"] and m["tbt_ms_median"] > 0 and m["throughput_tok_s"] > 0 and len(r["tbt_ms"]) == 3
        trace = Trace.load(r["trace"])
        assert trace.meta["real"] and all(s.t_collect >= s.t_submit for s in trace.steps)
        assert max(len(s.tokens) for s in trace.steps) == 3  # three requests in the pipeline at once
    code = main(["sim", "--trace", report["runs"][0]["trace"], "--profile", "h100-80gb"])
    assert code == 0
    assert "measured" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["--oracle", None])
def test_runs_without_traces(capsys, tiny_llama_dir, prompts, tmp_path, method):
    """No --trace-dir and no --plots: nothing records the steps (this crashed once: the runs set
    their step observer to None)."""
    report = bench(capsys, tiny_llama_dir, prompts, tmp_path, "--stages", "1", "--runs", "pp,specpipe",
                   *([method] if method else []))
    assert all(r["trace"] is None and r["all"]["tokens"] > 0 for r in report["runs"])


def test_stage_processes_time_themselves(capsys, tiny_llama_dir, prompts, tmp_path):
    """At S = 2 with stage processes the trace holds each stage's own compute spans (the stages'
    reports carry them), consistent with the driver's clock, and the timeline draws them without
    a profile."""
    report = bench(capsys, tiny_llama_dir, prompts, tmp_path, "--stages", "2", "--runs", "specpipe",
                   "--transport", "processes", "--stage-threads", "1", "--trace-dir", str(tmp_path / "traces"),
                   "--plots", str(tmp_path / "img"))
    trace = Trace.load(report["runs"][0]["trace"])
    assert has_stage_spans(trace)
    for s in trace.steps:
        spans = [sp for sp in s.stage_spans if sp]
        assert all(s.t_submit <= start <= end for start, end in spans)
        if s.rows[-1]:  # the last stage's results are what the driver collects
            assert s.stage_spans[-1][1] <= s.t_collect
    assert (tmp_path / "img" / "timeline_s2.png").stat().st_size > 0


def test_bad_arguments_are_one_line(capsys, tiny_llama_dir, prompts, tmp_path):
    for argv, words in ((["--runs", "pp,fast"], "unknown mode 'fast'"),
                        (["--runs", "specpipe:layers=x"], "not a valid value"),
                        (["--runs", "tree:size=3"], "NAME=VALUE"),
                        (["--groups", "poetry"], "unknown poetry"),
                        (["--runs", "pp", "--cost-profile", "h100-80gb"], "only steers --layers-per-step auto"),
                        (["--runs", "specpipe:layers=auto", "--cost-profile", "tpu"], "--cost-profile: no profile file")):
        dataset = [] if "--groups" in argv else ["--dataset", str(prompts)]
        assert main(["bench", "--model", str(tiny_llama_dir), *dataset, *argv]) == 2
        assert words in capsys.readouterr().err
    assert main(["sim", "--trace", str(prompts), "--profile", "h100-80gb"]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"format": "x"}')
    assert main(["sim", "--trace", str(tmp_path / "other.json"), "--profile", "h100-80gb"]) == 2
    assert "not a SpecPipe trace" in capsys.readouterr().err
    assert main(["sim", "--trace", str(prompts), "--profile", "tpu"]) == 2
    assert "shipped: a100-80gb" in capsys.readouterr().err
    assert main(["profile", "--roofline", "tpu-v9", "--out", str(tmp_path / "x.json")]) == 2
    assert "known: a100-80gb, h100-80gb, h200" in capsys.readouterr().err
    assert main(["profile", "--model", str(tiny_llama_dir), "--stage-layers", "2,9", "--out", str(tmp_path / "x.json")]) == 2
    assert "between 2 and the model's 4 layers" in capsys.readouterr().err


def test_run_specs():
    runs = parse_runs("pp, tree:depth=7:width=8,specpipe:layers=auto")
    assert [r.label for r in runs] == ["pp", "tree depth=7 width=8", "specpipe layers=auto"]
    assert runs[1].get("width") == 8 and runs[2].get("layers") == "auto"


def test_gpu_check_script_runs_on_cpu(tmp_path):
    """The GPU machine's prepared script, on its tiny CPU path: fp32 tokens equal across devices
    and modes (it exits non-zero otherwise), and its profile loads."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--small", "--repeats", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tokens"]["cpu_vs_device_fp32_same"] and all(summary["tokens"]["lossless_fp32_on_device"].values())
    assert CostProfile.load(tmp_path / "profile_cpu_tiny.json").stage(1, False, 4, 64) > 0
