"""Reasoning a model writes before its answer, `<think>…</think>` (Qwen3, DeepSeek-R1, GLM-4.5,
MiniMax-M2), returned apart from the answer: `message.reasoning_content` and, streamed,
`delta.reasoning_content`, as vLLM's reasoning parsers do.

    prompt ends in an open <think>  --> the answer starts inside the reasoning (DeepSeek-R1's,
                                        MiniMax-M2's templates open it for the model)
    answer starts with <think>      --> reasoning up to </think> (Qwen3, GLM-4.5)
    no </think> by the end          --> everything after <think> is reasoning (cut off by max_tokens)

Only a model whose chat template mentions `</think>` is read this way (Tokenizer.reasons); a `<think>` that is not
where the answer starts is content. The whitespace a template puts after `</think>` is dropped
from the content. Streamed text may split a tag anywhere: a tail that could begin one is held
until the next piece decides it.
"""

from __future__ import annotations

from typing import Optional

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last characters) leaves a `<think>` open for the model."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


class ReasoningSplitter:
    """Splits an answer, fed piece by piece, into (reasoning, content) pieces."""

    def __init__(self, in_think: bool = False) -> None:
        # start: nothing but whitespace yet; think: inside the reasoning; after: past </think>,
        # dropping whitespace; content: the answer proper
        self.state = "think" if in_think else "start"
        self.held = ""  # text not yet decided (a possible tag, or leading whitespace)
        self.reasoning: list[str] = []  # every reasoning piece handed out (None at the end if none)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content that `text` decides; `final`: no more text comes."""
        buf, self.held = self.held + text, ""
        reasoning, content = "", ""
        while buf:
            if self.state == "start":
                body = buf.lstrip()
                if body.startswith(OPEN):
                    self.state, buf = "think", body[len(OPEN):]
                elif OPEN.startswith(body) and not final:
                    self.held, buf = buf, ""  # whitespace, or a tag begun
                else:
                    self.state = "content"
            elif self.state == "think":
                end = buf.find(CLOSE)
                if end >= 0:
                    reasoning += buf[:end]
                    self.state, buf = "after", buf[end + len(CLOSE):]
                else:
                    keep = 0 if final else _tail_opening(buf, CLOSE)
                    reasoning += buf[:len(buf) - keep]
                    self.held, buf = buf[len(buf) - keep:], ""
            elif self.state == "after":
                buf = buf.lstrip()
                if buf:
                    self.state = "content"
            else:
                content, buf = content + buf, ""
        if reasoning:
            self.reasoning.append(reasoning)
        return reasoning, content

    @property
    def reasoning_text(self) -> Optional[str]:
        """All the reasoning so far; None when the answer had none."""
        return "".join(self.reasoning) if self.reasoning or self.state in ("think", "after") else None


def split_reasoning(text: str, in_think: bool = False) -> tuple[Optional[str], str]:
    """(reasoning or None, content) of a whole answer."""
    s = ReasoningSplitter(in_think)
    _, content = s.feed(text, final=True)
    return s.reasoning_text, content


def _tail_opening(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that begins `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)
