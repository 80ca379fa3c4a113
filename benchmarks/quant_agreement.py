"""How far the quantized path's logits are from the float32-dequantized path on the same file.

Method: real run on this machine. The same GGUF file is built twice: once as SpecPipe runs it
(packed weights, the kernel chosen per type, or --kernel), once dequantized to float32 at load
(kernel "float32", the old path). Both prefill the same prompt and then decode greedily from the
float32 path's tokens (teacher forcing, so the rows compared always have the same context);
reported: the largest absolute logit difference, that difference relative to the logits' spread,
and how many greedy tokens agree. Not a test: the numbers are what we publish.

    PYTHONPATH=. python benchmarks/quant_agreement.py [--model FILE.gguf] [--kernel int4pack] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from specpipe.config import StageSpec
from specpipe.loader.default_model import default_model_path
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage
from specpipe.tokenizer.tokenizer import Tokenizer

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def decode(model, prompt: list[int], steps: int, forced: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Prefill, then `steps` decode rows feeding `forced` tokens (or the model's own greedy
    ones). Returns the logits of the prompt's last row and of each decode row, and the tokens."""
    kv = model.make_kv_cache(len(prompt) + steps + 1)
    n = len(prompt)
    causal = np.tril(np.ones((n, n), dtype=bool))  # a prompt row sees itself and what precedes it
    out = [run_rows(model, kv, torch.tensor(prompt), list(range(n)), list(range(n)), list(range(n)), causal, [n - 1])]
    tokens = []
    for i in range(steps):
        tok = forced[i] if forced is not None else int(out[-1][-1].argmax())
        tokens.append(tok)
        pos = n + i
        out.append(run_rows(model, kv, torch.tensor([tok]), [pos], [pos], list(range(pos + 1)), None))
    return torch.cat(out), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--kernel", default=None, help="a kernel to prefer (default: the registry's choice)")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    path = args.model or str(default_model_path())
    ckpt = open_checkpoint(path)
    prompt = Tokenizer.from_path(path).encode(PROMPT)
    ref = build_stage(ckpt, StageSpec.whole(ckpt.config), kernel="float32")
    want, tokens = decode(ref, prompt, args.tokens)
    del ref
    quant = build_stage(ckpt, StageSpec.whole(ckpt.config), kernel=args.kernel)
    kinds = sorted({m.kernel for m in quant.modules() if hasattr(m, "kernel") and isinstance(m.kernel, str)})
    got, _ = decode(quant, prompt, args.tokens, forced=tokens)
    diff = (got - want).abs().max().item()
    spread = want.std().item()
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())
    print(json.dumps({"model": path.rsplit("/", 1)[-1], "kernels": kinds, "rows": len(want),
                      "max_abs_logit_diff": round(diff, 6), "logit_std": round(spread, 4),
                      "max_diff_over_std": round(diff / spread, 6),
                      "greedy_agree": f"{agree}/{len(want)}"}))


if __name__ == "__main__":
    main()
