"""The rooms import downwards only (docs/architecture.md): read from the code's own imports,
lazy ones inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specpipe"
BASE = {"config", "sampling", "request", "messages", "outputs"}
# room -> rooms it must not import
FORBIDDEN = {
    **{base: {"engine", "sim", "bench", "entrypoints", "distributed", "worker", "model", "kernels", "costs",
              "spec_decode", "sched", "kv", "loader", "tokenizer", "grammar"} for base in BASE},
    "kernels": {"engine", "sim", "bench", "entrypoints", "distributed", "worker", "model", "costs", "spec_decode",
                "sched", "kv", "grammar"},
    "model": {"engine", "sim", "bench", "entrypoints", "distributed", "worker", "costs", "spec_decode", "sched",
              "grammar"},
    "loader": {"engine", "sim", "bench", "entrypoints", "distributed", "worker", "costs", "spec_decode", "sched",
               "grammar"},
    "sched": {"engine", "sim", "bench", "entrypoints", "distributed", "worker", "model", "kernels", "costs",
              "spec_decode", "kv", "loader", "grammar"},
    "distributed": {"engine", "sim", "bench", "entrypoints", "worker", "model", "kernels", "costs", "spec_decode",
                    "sched", "kv", "loader", "tokenizer", "grammar"},
    "kv": {"engine", "sim", "bench", "entrypoints", "distributed", "worker", "costs", "spec_decode", "sched",
           "grammar"},
    # structured output: constraints compiled for a tokenizer, and token masks (torch only)
    "grammar": {"engine", "sim", "bench", "entrypoints", "distributed", "worker", "model", "kernels", "costs",
                "spec_decode", "sched", "kv", "loader", "cluster"},
    "worker": {"engine", "sim", "bench", "entrypoints", "costs", "spec_decode", "sched"},
    "costs": {"engine", "sim", "bench", "entrypoints", "spec_decode", "sched", "grammar"},
    "spec_decode": {"engine", "sim", "bench", "entrypoints", "sched"},
    "cluster": {"engine", "sim", "bench", "entrypoints"},
    "engine": {"sim", "bench", "entrypoints"},
}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path) -> set[str]:
    """Every specpipe room this file imports, at any depth."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        for name in names:
            if name.startswith("specpipe."):
                out.add(room(name))
            elif name == "specpipe" and isinstance(node, ast.ImportFrom):
                out.update(a.name for a in node.names)
    return out


FILES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_rooms_import_downwards(path):
    rel = path.relative_to(PACKAGE)
    own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    bad = imports(path) & FORBIDDEN.get(own, set())
    assert not bad, f"specpipe/{rel} imports {sorted(bad)}, which sit above {own}/"
