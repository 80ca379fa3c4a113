#!/usr/bin/env python3
"""Our native matmul against llama.cpp's own CPU kernels (ggml's mul_mat) per GGUF weight type, on
the same packed bytes, the same activations and the same thread counts, interleaved in one process
(real run; issue 60's first goal).

For each type, for each weight shape (default: Qwen2.5-1.5B's MLP, gate/up 8960 x 1536 and down
1536 x 8960, N output rows of K values): Gaussian weights quantized by ggml's own quantizer
(ggml_quantize_chunk; a random positive importance matrix for the types ggml requires one for,
IQ2_XXS, IQ2_XS, IQ1_S, and for IQ1_M); then for 1 and 8 activation rows at 1 and 2 threads, the
C driver benchmarks/lowbit_vs_ggml.c times, round after round with the order rotating:
  * ours: sp_matmul (the library's best ISA path, or --isa) on the bytes, and with --also-isa at
    a second path too (e.g. avx2 beside avx512vnni; its output must be bitwise ours);
  * ggml: a ggml graph of one ggml_mul_mat(W, x), x f32, computed by ggml's CPU backend with W in
    a CPU buffer over the same bytes (ggml's vec_dot kernels, llamafile's sgemm where it applies);
  * ggml_repack: the same with W in ggml's CPU_REPACK extra buffer type, where ggml takes the
    tensor on this CPU (llama.cpp puts weights there by default: Q4_0, Q4_K, IQ4_NL and MXFP4 with
    AVX2, Q2_K with AVX-512).
Before each timed call a --flush-mb buffer is read, so W comes from memory as in decode (0: off),
and the driver sleeps --pause-us, so that on a machine loaded by other processes the call tends to
start on a fresh time slice instead of being cut by the scheduler (on 2 shared vCPUs at load 12
this took the one-thread medians from several ms of preemption back to the minimum; it cannot
help a 2-thread call, whose second thread must wait for a vCPU that other processes hold).
Reported per (type, shape, rows, threads): each path's median ms, the ratio ggml / ours against
the faster of ggml's paths (> 1: ours is faster; ratio_min: the same of the minimum times, less
sensitive to other processes' load), and the max abs error of each path's output
against the float product of ggml's dequantized W and x, over max |that product| ("agree": ours
is within 2x ggml's own error + 1e-5; the two quantize activations differently, so they are not
bitwise equal).

ggml comes from a pip-installed llama-cpp-python (`pip install llama-cpp-python`, built from
source; its libggml*.so under site-packages/llama_cpp/lib, or --ggml-lib); ggml's headers, which
the wheel does not ship, from llama-cpp-python's sdist of the installed version: downloaded once
with pip into ~/.cache/specpipe/ggml_headers/<version> ($SPECPIPE_GGML_HEADERS overrides; only
ggml/include is kept), or --ggml-include. Our library: --library PATH, else $SPECPIPE_NATIVE_LIBRARY,
else built (build.py) from the committed sources of --commit (default HEAD) in a temporary
directory, so the measured kernels are a commit's, whatever the working tree holds.

    PYTHONPATH=. python benchmarks/lowbit_vs_ggml.py [--types Q2_K Q3_K ...] [--rows 1 8]
        [--threads 1 2] [--reps 15] [--shapes 8960x1536 1536x8960] [--flush-mb 64] [--pause-us 3000]
        [--also-isa 1] [--commit HEAD | --library PATH] [--out benchmarks/results/lowbit_vs_ggml.json]
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().with_suffix(".c")
TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_0": 8, "IQ1_S": 19, "IQ1_M": 29,
         "IQ2_XXS": 16, "IQ2_XS": 17, "IQ2_S": 22, "IQ3_XXS": 18, "IQ3_S": 21, "IQ4_NL": 20, "IQ4_XS": 23,
         "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39}
GOAL = {"Q2_K": 1.0, "Q3_K": 1.0, "IQ4_XS": 1.0, "MXFP4": 1.0}  # issue 60; the others 0.8
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512vnni", 3: "neon", 4: "amx"}
HEADERS_ENV = "SPECPIPE_GGML_HEADERS"


def llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("llama-cpp-python is not installed (pip install llama-cpp-python: builds ggml from source)")


def ggml_lib_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llama_cpp not found: pip install llama-cpp-python, or pass --ggml-lib DIR")
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    if not (lib / "libggml-cpu.so").exists():
        sys.exit(f"no libggml-cpu.so in {lib}; pass --ggml-lib DIR")
    return lib


def ggml_include(given: str | None, version: str) -> Path:
    """ggml/include of llama-cpp-python's sdist (the wheel does not ship the headers), fetched with
    pip once per version (as tests/llama_converter.py fetches the converter)."""
    if given:
        return Path(given)
    cache = Path(os.environ.get(HEADERS_ENV) or Path.home() / ".cache" / "specpipe" / "ggml_headers" / version)
    done = cache / "include"
    if (done / "ggml.h").is_file():
        return done
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (done / "ggml.h").is_file():
            return done
        found = sorted(cache.glob(f"llama_cpp_python-{version}.tar.gz"))
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
                   "--no-deps", "--disable-pip-version-check", "-d", str(cache)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(cache.glob(f"llama_cpp_python-{version}.tar.gz"))
            if run.returncode != 0 or not found:
                sys.exit(f"could not download llama-cpp-python {version}'s sdist:\n{run.stderr[-2000:]}")
        staging = cache / "extracting"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        with tarfile.open(found[0]) as tar:
            for member in tar.getmembers():
                _, _, rest = member.name.partition("/")
                prefix = "vendor/llama.cpp/ggml/include/"
                if member.isfile() and rest.startswith(prefix) and "/" not in rest[len(prefix):]:
                    with tar.extractfile(member) as src, open(staging / Path(rest).name, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        staging.rename(done)
        found[0].unlink()
    return done


def our_library(args, tmp: Path) -> tuple[Path, dict]:
    """(the library, what it is): --library, $SPECPIPE_NATIVE_LIBRARY, or built from --commit."""
    path = args.library or os.environ.get("SPECPIPE_NATIVE_LIBRARY", "").strip()
    if path:
        return Path(path), {"library": str(path), "built_from": "given"}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.commit], capture_output=True, text=True,
                            check=True).stdout.strip()
    src = tmp / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "specpipe/kernels/native"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(src)], input=archive, check=True)
    out = tmp / "libspecpipe_native.so"
    print(f"building our library from {commit[:12]}'s specpipe/kernels/native ...", flush=True)
    subprocess.run([sys.executable, str(src / "specpipe/kernels/native/build.py"), "--out", str(out)], check=True)
    if not out.exists():
        sys.exit("our library did not build")
    return out, {"library": "built", "built_from": commit}


def cpu_info() -> dict:
    name, flags, ident = "unknown", set(), {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in ("cpu family", "model") and key not in ident:
            ident[key] = value
        if line.startswith("model name") and name == "unknown":
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
             if f in flags]
    return {"cpu": name, "cpu_family_model": f"{ident.get('cpu family')}/{ident.get('model')}",
            "vcpus": os.cpu_count(), "flags": shown}


def summarize(rec: dict) -> dict:
    paths = ("ours", "ggml", "ggml_repack", "ours_isa2")
    med = {p: statistics.median(rec[f"ms_{p}"]) for p in paths if f"ms_{p}" in rec}
    best = min(v for p, v in med.items() if p.startswith("ggml"))
    low = {p: min(rec[f"ms_{p}"]) for p in med}
    err_ggml = rec["err_ggml_ref"]
    return {
        "type": rec["type_name"].upper(), "n": rec["n"], "k": rec["k"], "rows": rec["rows"],
        "threads": rec["threads"], "ms": med, "ratio": best / med["ours"],
        "ratio_vs_plain": med["ggml"] / med["ours"], "ms_min": low,
        "ratio_min": min(v for p, v in low.items() if p.startswith("ggml")) / low["ours"],
        **({"isa2": ISA_NAMES.get(rec["isa2"], rec["isa2"]), "ratio_isa2": best / med["ours_isa2"],
            "err_ours2_ref": rec["err_ours2_ref"], "bitwise_ours_ours2": rec["err_ours_ours2"] == 0}
           if "ms_ours_isa2" in rec else {}),
        "err_ours_ref": rec["err_ours_ref"], "err_ggml_ref": err_ggml, "err_ours_ggml": rec["err_ours_ggml"],
        "agree": rec["err_ours_ref"] <= 2 * err_ggml + 1e-5,
    }


def type_table(rows: list[dict]) -> str:
    """One line per type: per (rows, threads) the shapes' medians summed (a gate/up plus a down
    projection with the defaults), ours / ggml's faster path, ggml / ours, and in brackets the
    same ratio of the summed minimum times (and of our --also-isa path's medians); the largest
    errors."""
    cells = sorted({(s["rows"], s["threads"]) for s in rows}, key=lambda c: (c[1], c[0]))
    head = [f"{r} row{'s' if r > 1 else ''}, {t} thr: ours / ggml ms, ggml/ours (min)" for r, t in cells]
    out = ["| type | ggml paths | " + " | ".join(head) + " | max rel err ours / ggml | goal |",
           "|---|---|" + "---|" * len(cells) + "---|---|"]

    def ggml_best(s: dict, key: str) -> float:
        return min(v for p, v in s[key].items() if p.startswith("ggml"))

    for name in dict.fromkeys(s["type"] for s in rows):
        mine = [s for s in rows if s["type"] == name]
        line = f"| {name} | {'vec_dot, ' + mine[0]['repack'] if mine[0]['repack'] else 'vec_dot'} |"
        for r, t in cells:
            sel = [s for s in mine if (s["rows"], s["threads"]) == (r, t)]
            ours, ggml = sum(s["ms"]["ours"] for s in sel), sum(ggml_best(s, "ms") for s in sel)
            low = sum(ggml_best(s, "ms_min") for s in sel) / sum(s["ms_min"]["ours"] for s in sel)
            other = ""
            if all("ours_isa2" in s["ms"] for s in sel):
                other = f"; {sel[0]['isa2']} {ggml / sum(s['ms']['ours_isa2'] for s in sel):.2f}"
            line += f" {ours:.3g} / {ggml:.3g}, **{ggml / ours:.2f}** ({low:.2f}{other}) |"
        line += (f" {max(s['err_ours_ref'] for s in mine):.1e} / {max(s['err_ggml_ref'] for s in mine):.1e}"
                 f"{'' if all(s['agree'] for s in mine) else ' (!)'} | ≥ {GOAL.get(name, 0.8)} |")
        out.append(line)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    ap.add_argument("--shapes", nargs="+", default=["8960x1536", "1536x8960"], help="NxK (N rows of K values)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--flush-mb", type=int, default=64, help="read this many MB before each timed call (0: off)")
    ap.add_argument("--pause-us", type=int, default=3000, help="sleep before each timed call (0: none)")
    ap.add_argument("--isa", type=int, default=-1, help="our path: 0 portable, 1 avx2, 2 avx512vnni (default: best)")
    ap.add_argument("--also-isa", type=int, default=-1,
                    help="time our kernels at this path too (e.g. 1: avx2 beside the best), interleaved")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--commit", default="HEAD", help="build our library from this commit's sources")
    ap.add_argument("--library", help="our library as built (instead of --commit)")
    ap.add_argument("--ggml-lib", help="the directory of libggml*.so (default: llama_cpp's lib)")
    ap.add_argument("--ggml-include", help="ggml's headers (default: from the sdist, cached)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/lowbit_vs_ggml.json"))
    args = ap.parse_args()

    version = llama_cpp_version() if not (args.ggml_lib and args.ggml_include) else "given"
    lib_dir, include = ggml_lib_dir(args.ggml_lib), ggml_include(args.ggml_include, version)
    tmp = Path(tempfile.mkdtemp(prefix="lowbit_vs_ggml_"))
    try:
        ours, ours_info = our_library(args, tmp)
        exe = tmp / "lowbit_vs_ggml"
        cc = os.environ.get("CC") or "cc"
        subprocess.run([cc, "-O2", "-fopenmp", "-I", str(include), "-o", str(exe), str(DRIVER), "-L", str(lib_dir),
                        "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{lib_dir}", "-ldl", "-lm"], check=True)
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **cpu_info(),
                "llama_cpp_python": version, "ggml_lib": str(lib_dir), **ours_info,
                "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                "reps": args.reps, "flush_mb": args.flush_mb, "pause_us": args.pause_us,
                "loadavg_start": os.getloadavg()}
        print(json.dumps(meta), flush=True)
        records, rows = [], []
        for name in args.types:
            for shape in args.shapes:
                n, k = (int(v) for v in shape.lower().split("x"))
                load = os.getloadavg()[0]
                run = subprocess.run([str(exe), str(ours), str(TYPES[name]), str(n), str(k),
                                      ",".join(map(str, args.rows)), ",".join(map(str, args.threads)), str(args.reps),
                                      str(args.flush_mb), str(args.seed), str(args.pause_us), str(args.isa),
                                      str(args.also_isa)],
                                     capture_output=True, text=True)
                if run.returncode != 0:
                    print(f"{name} {shape}: driver failed ({run.returncode}): {run.stderr[-800:]}", flush=True)
                    records.append({"type_name": name, "n": n, "k": k, "error": run.stderr[-800:]})
                    continue
                for line in run.stdout.splitlines():
                    rec = json.loads(line)
                    rec["loadavg_1min"] = load
                    records.append(rec)
                    s = summarize(rec)
                    s["repack"] = rec["repack"]
                    s["isa"] = ISA_NAMES.get(rec["isa"], rec["isa"])
                    rows.append(s)
                    ms = s["ms"]
                    print(f"{s['type']:8} {n}x{k} rows {s['rows']} thr {s['threads']}: ours {ms['ours']:.3f} "
                          f"ggml {ms['ggml']:.3f} repack {ms.get('ggml_repack', float('nan')):.3f} ms, "
                          f"ratio {s['ratio']:.2f}, err ours {s['err_ours_ref']:.2e} ggml {s['err_ggml_ref']:.2e}"
                          f" ours-ggml {s['err_ours_ggml']:.2e} load {load:.1f}"
                          + (f"; {s['isa2']} {ms['ours_isa2']:.3f} ms, ratio {s['ratio_isa2']:.2f}, bitwise "
                             f"{s['bitwise_ours_ours2']}" if "isa2" in s else ""), flush=True)
        meta["loadavg_end"] = os.getloadavg()
        print("\n| type | N x K | rows | threads | ours ms | ggml ms | ggml repack ms | ggml/ours | goal | "
              "max rel err ours / ggml (vs float) | ours vs ggml |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for s in rows:
            goal = GOAL.get(s["type"], 0.8)
            rp = f"{s['ms']['ggml_repack']:.3f}" if "ggml_repack" in s["ms"] else "—"
            print(f"| {s['type']} | {s['n']} x {s['k']} | {s['rows']} | {s['threads']} | {s['ms']['ours']:.3f} | "
                  f"{s['ms']['ggml']:.3f} | {rp} | {s['ratio']:.2f} {'✓' if s['ratio'] >= goal else '✗'} | "
                  f"≥ {goal} | {s['err_ours_ref']:.1e} / {s['err_ggml_ref']:.1e}{'' if s['agree'] else ' (!)'} | "
                  f"{s['err_ours_ggml']:.1e} |")
        print("\n" + type_table(rows) + "\n")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({**meta, "summary": rows, "records": records}, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
