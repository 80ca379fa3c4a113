"""Without the native library (issue 49): GGUF weights stay packed and run on the portable
`dequant` kernel, within 1.3x the file; the run says so once; `specpipe env` names the kernel;
and where both paths are exact they give the same tokens.

"An install with the library removed" is a subprocess with SPECPIPE_NATIVE_LIBRARY pointing at
nothing (the loader then finds no library, as after an install without a compiler)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import gguf
import numpy as np
import pytest
import torch

from specpipe.kernels import native
from specpipe.kernels.ggml_types import dequantize
from specpipe.kernels.torch_kernels import dequantize_into, invariant_linear, tile_rows, tiled_dequant_linear
from proc_helpers import CLI, clean_env

Q = gguf.GGMLQuantizationType
NO_LIBRARY = {"SPECPIPE_NATIVE_LIBRARY": "/nonexistent/libspecpipe_native.so", "SPECPIPE_KERNEL": ""}


def _quantized(n: int, k: int, qtype: Q, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 2
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, qtype)))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1])
def test_fast_dequantize_is_the_reference(qtype):
    packed = _quantized(70, 256, qtype)
    out = torch.empty(70, 256)
    assert torch.equal(dequantize_into(packed, qtype, out), dequantize(packed, qtype))
    # a tile of rows, and rows at an odd byte offset in their buffer (read through the reference)
    assert torch.equal(dequantize_into(packed[3:9], qtype, out[:6]), dequantize(packed[3:9], qtype))
    shifted = torch.zeros(packed.numel() + 1, dtype=torch.uint8)[1:].view(packed.shape).copy_(packed)
    assert torch.equal(dequantize_into(shifted, qtype, out), dequantize(packed, qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_tiled_matmul_is_batch_invariant_and_close_to_the_float32_path(qtype):
    """A tile of weight rows at a time, the tiles fixed by the weight's shape: a row's output is
    the same alone or among others. Against the whole dequantized matrix's float matmul (the
    float32 path) it is close, not always bitwise: MKL's sgemm sums a column in an order that
    depends on the number of weight rows in the call (on this Xeon, 128 or 448 rows gave other
    bits than 2048, 256 or 512 did not)."""
    k = 576
    n = 2 * tile_rows(k) + 40  # two whole tiles and a short one
    packed = _quantized(n, k, qtype)
    w = dequantize(packed, qtype)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(0))
    together = tiled_dequant_linear(x, packed, qtype)
    for t in range(9):
        assert torch.equal(tiled_dequant_linear(x[t:t + 1], packed, qtype)[0], together[t]), t
    torch.testing.assert_close(together, invariant_linear(x, w), rtol=1e-5, atol=1e-4)


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=clean_env(**env))


FALLBACK_STAGE = """
import json, os, sys, torch
from specpipe.config import StageSpec
from specpipe.kernels import native
from specpipe.kernels.qlinear import QuantLinear
from specpipe.loader import open_checkpoint
from specpipe.loader.default_model import default_model_path
from specpipe.model.stage import build_stage, weight_nbytes
path = default_model_path()
ckpt = open_checkpoint(path)
spec = StageSpec(0, ckpt.config.num_layers, True, True)
model = build_stage(ckpt, spec)
kernels = sorted({m.kernel for m in model.modules() if isinstance(m, QuantLinear)})
ids = torch.tensor([1, 9690, 198, 504, 3575, 282, 4649, 314])
from specpipe.model.runner import run_rows
def forward(model, ids):
    n = len(ids)
    return run_rows(model, model.make_kv_cache(n), ids, list(range(n)), list(range(n)), list(range(n)), None)
logits = forward(model, ids)
ref = forward(build_stage(ckpt, spec, kernel="float32"), ids)
same = {"max_diff": (logits - ref).abs().max().item() / ref.std().item(),
        "argmax_equal": torch.equal(logits.argmax(-1), ref.argmax(-1))}
print(json.dumps({"native": native.available(), "kernels": kernels, "weights": weight_nbytes(model),
                  "file": os.path.getsize(path), "same_as_float32": same}))
"""


def test_without_the_library_the_default_model_stays_packed(smollm2):
    """The Q4_1 default model's weights (every matrix, the tied head included) stay within 1.3x
    the file, on the portable kernel, and its logits are the float32 path's (the same weights;
    a column's sum may be grouped otherwise, see above)."""
    p = _run([sys.executable, "-c", FALLBACK_STAGE], **NO_LIBRARY)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout.splitlines()[-1])
    assert d["native"] is False and d["kernels"] == ["dequant"]
    assert d["weights"] <= 1.3 * d["file"], d
    assert d["same_as_float32"]["max_diff"] < 1e-4 and d["same_as_float32"]["argmax_equal"], d


def test_without_the_library_generate_warns_once_and_reports_the_kernels(smollm2):
    """Two stage processes and the driver: one warning, on the driver, naming the fix; the
    stats name the kernel per weight type."""
    p = _run([*CLI, "generate", "--max-tokens", "4", "--json", "--quiet", "--stages", "2", "--kv-memory",
              "16MiB", "Name the capital of France."], **NO_LIBRARY)
    assert p.returncode == 0, p.stderr
    warned = [ln for ln in p.stderr.splitlines() if "native CPU kernels are not in use" in ln]
    assert len(warned) == 1, p.stderr
    assert "python3 -m specpipe.kernels.native.build" in warned[0] and "C compiler" in warned[0]
    kernels = json.loads(p.stdout.splitlines()[-1])["stats"]["kernels"]
    assert kernels["weights"] == {"Q4_1": "dequant", "Q8_0": "dequant"}
    assert kernels["native_isa"] is None and "not built" in kernels["native_library"]


def test_report_unavailable_says_it_once(tmp_path, monkeypatch):
    for name, value in (("_lib", None), ("_load_error", None), ("_refused", False), ("_reported", False)):
        monkeypatch.setattr(native, name, value)
    monkeypatch.setenv("SPECPIPE_NATIVE_LIBRARY", str(tmp_path / "none.so"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not native.available()  # a library that is simply missing: the loader stays quiet
        first = native.report_unavailable()
        assert native.report_unavailable() is None and native.report_unavailable(print) is None
    assert len(caught) == 1 and str(caught[0].message) == first
    assert "not built" in first and native.REBUILD in first


def test_env_names_the_kernel_in_use(smollm2, capsys):
    from specpipe.entrypoints.cli import main

    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    expected = "native" if native.available() else "dequant"
    assert info["kernels"]["weights"] == {"Q4_1": expected, "Q8_0": expected}
    assert info["native_library"]["loaded"] == native.available()
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert f"Q4_1: {expected}" in text and "torch" in text and "ray" in text


def test_env_without_the_library_says_what_to_do(smollm2):
    p = _run([*CLI, "env"], **NO_LIBRARY)
    assert p.returncode == 0, p.stderr
    assert "Q4_1: dequant" in p.stdout and "not built" in p.stdout
    assert "To fix: reinstall with a C compiler" in p.stdout and native.REBUILD in p.stdout


@pytest.mark.skipif(not native.available(), reason="compares the native path with the portable one")
def test_float_weights_give_the_same_tokens_with_and_without_the_library(tiny_llama_dir):
    """Float weights: both paths multiply the same float32 weights (the native library adds its
    attention, RMSNorm and RoPE, written to give the torch forms' results), so the greedy tokens
    agree. (GGUF blocks do not: the native kernel quantizes activations to int8 blocks, the
    portable kernel multiplies float32 activations; docs/quantized_weights.md.)"""
    args = [*CLI, "generate", "--model", str(tiny_llama_dir), "--max-tokens", "24", "--ignore-eos", "--json",
            "--quiet", "--kv-memory", "16MiB", "the cat sat on the mat"]
    with_lib, without = _run(args), _run(args, **NO_LIBRARY)
    assert with_lib.returncode == 0 and without.returncode == 0, without.stderr
    a, b = (json.loads(p.stdout.splitlines()[-1]) for p in (with_lib, without))
    assert a["stats"]["kernels"]["native_isa"] and b["stats"]["kernels"]["native_isa"] is None
    assert a["token_ids"] == b["token_ids"]


def test_without_the_library_the_server_logs_it_once_and_reports_the_kernels(smollm2):
    """`specpipe serve` on the default model: one warning line in its log, and /health and
    /metrics name the portable kernel for both weight types."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from proc_helpers import Run, kill_session

    run = Run(["serve", "--port", "0", "--stages", "2", "--kv-memory", "16MiB", "--log-level", "warning"],
              env=clean_env(**NO_LIBRARY))
    try:
        run.wait_for_stderr("serving ", 1, timeout_s=300)
        url = next(ln for ln in run.err_lines if "serving " in ln).split(" on ")[-1].strip()
        kernels = httpx.get(f"{url}/health", timeout=60).json()["kernels"]
        assert kernels["weights"] == {"Q4_1": "dequant", "Q8_0": "dequant"} and kernels["native_isa"] is None
        info = {tuple(sorted(s.labels.items())) for fam in text_string_to_metric_families(
                httpx.get(f"{url}/metrics", timeout=60).text) for s in fam.samples if s.name == "specpipe:kernel_info"}
        assert {dict(labels)["weight_type"]: dict(labels)["kernel"] for labels in info} == kernels["weights"]
        assert all(dict(labels)["isa"] == "none" for labels in info)
    finally:
        kill_session(run.proc)
    warned = [ln for ln in run.err_lines if "native CPU kernels are not in use" in ln]
    assert len(warned) == 1 and warned[0].startswith("specpipe: warning:"), run.stderr


def test_without_the_library_llm_warns_once(tiny_llama_dir):
    script = f"""
import warnings
warnings.simplefilter("always")
from specpipe import LLM
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        LLM({str(tiny_llama_dir)!r}, kv_memory="16MiB").close()
print(sum("native CPU kernels are not in use" in str(w.message) for w in caught))
"""
    p = _run([sys.executable, "-c", script], **NO_LIBRARY)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == "1"
