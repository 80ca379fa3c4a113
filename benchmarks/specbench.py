"""Spec-Bench prompts (../shared/data/spec_bench/question.jsonl), grouped as the benchmark does."""

from __future__ import annotations

import json
import os
from pathlib import Path

GROUPS = {  # question_id ranges of the six task groups
    "mt_bench": (81, 160),
    "translation": (161, 240),
    "summarization": (241, 320),
    "qa": (321, 400),
    "math_reasoning": (401, 480),
    "rag": (481, 560),
}


def data_file() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (os.environ.get("SPECBENCH_FILE"), here.parent / "shared/data/spec_bench/question.jsonl",
                      here.parent.parent / "shared/data/spec_bench/question.jsonl"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise FileNotFoundError("Spec-Bench question.jsonl not found; set SPECBENCH_FILE")


def load_prompts(per_group: int, offset: int = 0, path: Path | None = None) -> list[dict]:
    """`per_group` prompts from each group (first turn only): [{"group", "question_id", "text"}]."""
    questions = [json.loads(line) for line in (path or data_file()).read_text().splitlines() if line.strip()]
    out = []
    for group, (lo, hi) in GROUPS.items():
        chosen = [q for q in questions if lo <= q["question_id"] <= hi][offset:offset + per_group]
        out += [{"group": group, "question_id": q["question_id"], "text": q["turns"][0]} for q in chosen]
    return out
