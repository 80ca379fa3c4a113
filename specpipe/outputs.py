"""What a finished request gives back: one type for the CLI, the Python API and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specpipe.request import Request


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class RequestOutput:
    """One prompt's result: text, token ids, why it ended (stop | length | abort | error), stats."""

    request_id: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    error: Optional[str] = None

    @staticmethod
    def of(req: Request, stats: dict, prompt: Optional[str] = None) -> "RequestOutput":
        return RequestOutput(req.request_id, prompt, req.prompt_ids, req.text, list(req.output_ids),
                             req.finish_reason or "length", stats, req.error)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape (`out.outputs[0].text`), for code written against it."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason)]

    def as_dict(self) -> dict:
        """`specpipe generate --json`'s object."""
        return {"text": self.text, "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "stats": self.stats}
