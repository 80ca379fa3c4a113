"""llama.cpp's own converter (convert_hf_to_gguf.py), taken from llama-cpp-python's source
distribution and run on the tiny Hugging Face checkpoints, so the GGUF tests read files as
llama.cpp writes them rather than as our imitation of it (checkpoint_helpers.gguf_twin) does.

    convert(hf_dir, out_path, outtype="f32") -> out_path

The sdist (~73 MB, PyPI) is downloaded once into a cache directory ($SPECPIPE_LLAMA_CONVERTER_CACHE,
else ~/.cache/specpipe/llama_converter/<version>), and only the converter, its `conversion`
package and its bundled gguf-py are extracted (2 MB; the tarball is then deleted); a file lock
makes concurrent pytest workers share one download. The converter runs in a subprocess with its bundled gguf-py first on sys.path (not
the pip `gguf` the loader uses), with two adjustments for tiny test checkpoints, both outside the
tensor and metadata code under test:
  * its BPE pre-tokenizer check hashes the tokens of a fixed text against the tokenizers of
    released models, and the tiny byte-level BPE is none of them: when the hash is unknown the
    pre-tokenizer is named `pre` ("gpt-2", which the tiny tokenizer is) instead of an error;
  * a family whose tokenizer the converter looks up special tokens of by name (GLM's
    _set_vocab_glm: [gMASK], <|user|>, <|observation|>) is converted from a copy of its directory
    whose tiny tokenizer has them added (NEEDED_SPECIAL_TOKENS);
  * where `sentencepiece` is not installed, a checkpoint without tokenizer.model gets the
    FileNotFoundError that sends the converter on to its BPE path, as it would with it installed
    (the converter imports sentencepiece before it looks for the file).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
CACHE_ENV = "SPECPIPE_LLAMA_CONVERTER_CACHE"
# model_type -> the special tokens the converter requires its tokenizer to hold.
NEEDED_SPECIAL_TOKENS = {"glm4_moe": ("[gMASK]", "<|user|>", "<|observation|>", "<|endoftext|>")}
_MEMBERS = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")

# Run as `python -c DRIVER root pre args...`: the converter's __main__ with the two adjustments.
_DRIVER = """
import importlib.util, runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
if importlib.util.find_spec("sentencepiece") is None:
    sentencepiece = base.TextModel._create_vocab_sentencepiece
    def _create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return sentencepiece(self)
    base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "specpipe" / "llama_converter" / VERSION


def converter_dir() -> Path:
    """The directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/ (downloaded and
    extracted on first use)."""
    cache = cache_dir()
    done = cache / "llama.cpp"
    if (done / "convert_hf_to_gguf.py").is_file():
        return done
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (done / "convert_hf_to_gguf.py").is_file():
            tarball = _sdist(cache)
            _extract(tarball, cache, done)
            tarball.unlink()  # 73 MB, of which the converter is 2
    return done


def _sdist(cache: Path) -> Path:
    found = sorted(cache.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-binary", ":all:",
           "--no-deps", "--disable-pip-version-check", "-d", str(cache)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if run.returncode != 0 or not found:
        raise RuntimeError(f"could not download llama-cpp-python {VERSION}'s sdist:\n{run.stdout[-2000:]}"
                           f"{run.stderr[-2000:]}")
    return found[0]


def _extract(tarball: Path, cache: Path, done: Path) -> None:
    """Only the converter's files, into a fresh directory renamed into place when complete."""
    staging = cache / "extracting"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            top, _, rest = member.name.partition("/")
            if not member.isfile() or not rest.startswith(_MEMBERS) or ".." in rest.split("/"):
                continue
            target = staging / rest.removeprefix("vendor/")
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    staging.joinpath("llama.cpp").rename(done)
    shutil.rmtree(staging)


def convert(hf_dir, out_path, outtype: str = "f32", pre: str = "gpt-2") -> Path:
    """Convert the Hugging Face directory `hf_dir` to the GGUF file `out_path` with llama.cpp's
    convert_hf_to_gguf.py; `pre`: the pre-tokenizer named when the converter does not know the
    tokenizer (see the module docstring)."""
    root = converter_dir()
    out_path = Path(out_path)
    hf_dir = with_special_tokens(Path(hf_dir), out_path.with_name(out_path.stem + "_hf"))
    cmd = [sys.executable, "-c", _DRIVER, str(root), pre, str(hf_dir), "--outfile", str(out_path),
           "--outtype", outtype]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir} (exit {run.returncode}):\n"
                           f"{run.stderr[-4000:]}")
    return out_path


def with_special_tokens(hf_dir: Path, copy_dir: Path) -> Path:
    """`hf_dir`, or where its family needs special tokens its tokenizer lacks, a copy at
    `copy_dir` whose tokenizer.json has them added (as special tokens, at the next free ids)."""
    from tokenizers import AddedToken, Tokenizer

    model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type")
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    missing = [t for t in NEEDED_SPECIAL_TOKENS.get(model_type, ()) if tok.token_to_id(t) is None]
    if not missing:
        return hf_dir
    shutil.rmtree(copy_dir, ignore_errors=True)
    shutil.copytree(hf_dir, copy_dir)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    tok.save(str(copy_dir / "tokenizer.json"))
    return copy_dir
