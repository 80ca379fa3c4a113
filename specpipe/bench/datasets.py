"""Prompt sets for the benchmarks: Spec-Bench (grouped as the benchmark does) and plain JSONL files.

Spec-Bench's question.jsonl is not shipped with the package; `data_file` finds it (see there).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

GROUPS = {  # question_id ranges of the six task groups
    "mt_bench": (81, 160),
    "translation": (161, 240),
    "summarization": (241, 320),
    "qa": (321, 400),
    "math_reasoning": (401, 480),
    "rag": (481, 560),
}

_SPECBENCH_REL = "shared/data/spec_bench/question.jsonl"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def data_file(path: str | Path | None = None) -> Path:
    """Spec-Bench's question.jsonl: `path` if given, else $SPECBENCH_FILE, else
    shared/data/spec_bench/question.jsonl under the repository root or its parent."""
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"Spec-Bench file not found: {path}")
        return Path(path)
    for candidate in (os.environ.get("SPECBENCH_FILE"), _REPO_ROOT / _SPECBENCH_REL,
                      _REPO_ROOT.parent / _SPECBENCH_REL):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise FileNotFoundError("Spec-Bench question.jsonl not found: pass --dataset-path or set SPECBENCH_FILE "
                            f"(also looked for {_SPECBENCH_REL} under {_REPO_ROOT} and its parent)")


def load_prompts(per_group: int, offset: int = 0, path: str | Path | None = None) -> list[dict]:
    """`per_group` prompts from each group (first turn only): [{"group", "question_id", "text"}]."""
    questions = [json.loads(line) for line in data_file(path).read_text().splitlines() if line.strip()]
    out = []
    for group, (lo, hi) in GROUPS.items():
        chosen = [q for q in questions if lo <= q["question_id"] <= hi][offset:offset + per_group]
        out += [{"group": group, "question_id": q["question_id"], "text": q["turns"][0]} for q in chosen]
    return out


def sample_specbench(n: int, seed: int = 0, path: str | Path | None = None) -> list[dict]:
    """`n` Spec-Bench prompts taken round-robin over the six groups, so that every group is
    represented (n >= 6); each group's order is shuffled by `seed`. Starts over when n exceeds the
    file. Returns [{"prompt", "group", "question_id"}]."""
    rng = random.Random(seed)
    by_group = {group: [] for group in GROUPS}
    for p in load_prompts(per_group=10**9, path=path):
        by_group[p["group"]].append(p)
    for prompts in by_group.values():
        rng.shuffle(prompts)
    rounds = max((len(v) for v in by_group.values()), default=0)
    ordered = [ps[i] for i in range(rounds) for ps in by_group.values() if i < len(ps)]
    if not ordered:
        raise ValueError("Spec-Bench file holds no prompts in the known groups")
    return [{"prompt": p["text"], "group": p["group"], "question_id": p["question_id"]}
            for p in (ordered[i % len(ordered)] for i in range(n))]


def load_jsonl(path: str | Path) -> list[dict]:
    """Prompts from a JSONL file, one JSON object a line with the prompt under "prompt", "text" or
    "turns" (the first turn) and an optional "max_tokens". Blank lines are skipped.
    Returns [{"prompt": str, "max_tokens": int | None}]; raises ValueError naming the bad line."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompt = obj.get("prompt", obj.get("text"))
        if prompt is None and isinstance(obj.get("turns"), list) and obj["turns"]:
            prompt = obj["turns"][0]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'{where}: needs a non-empty string under "prompt", "text" or "turns"[0]')
        max_tokens = obj.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise ValueError(f'{where}: "max_tokens" must be a positive integer, got {max_tokens!r}')
        out.append({"prompt": prompt, "max_tokens": max_tokens})
    return out
