"""gpt-oss's Harmony format: the model writes messages in channels, each with a header, and the
server reads them into OpenAI's fields, as vLLM does for gpt-oss.

    prompt ends  <|start|>assistant                         (the template's generation prompt)
    the model    <|channel|>analysis<|message|>REASONING<|end|>
                 <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
            or   <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

    analysis                         --> reasoning_content
    final, commentary (no recipient) --> content (a commentary without recipient is a preamble)
    to=functions.NAME (any channel)  --> tool_calls, when NAME is offered and ARGS parse as an object;
                                         else its text is content, so nothing the model wrote is lost

A header is everything between <|start|> (or the start of the answer) and <|message|>: the role,
`<|channel|>NAME`, a recipient `to=...` (before or after the channel: the template writes it
before, the model after) and a content type (`<|constrain|>json`, or a bare word). <|return|> and
<|call|> end generation (stop tokens); an answer cut off (max_tokens) closes its last message as
it stands. Streamed text is held while it is a header, or a tail that may begin a marker.

The chat template (the model's own, rendered as any other) reads an earlier answer's reasoning
from `thinking` and renders one call per assistant message: `template_messages` fits an OpenAI
conversation to that. Structured output under Harmony: harmony_grammar.py.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from specpipe.entrypoints.openai.tools import ToolCall

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKUP = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)  # kept in the answer's text
_CLOSERS = (END, RETURN, CALL)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def speaks_harmony(tokenizer) -> bool:
    """The model's template and vocabulary are Harmony's (gpt-oss)."""
    template = getattr(tokenizer, "_chat_template", None) or ""
    return CHANNEL in template and all(tokenizer.token_to_id(t) is not None for t in (START, MESSAGE, CHANNEL, END))


def harmony_ids(tokenizer) -> frozenset[int]:
    """The ids of Harmony's markup tokens (kept in the answer's text, which the parser reads)."""
    return frozenset(i for i in map(tokenizer.token_to_id, MARKUP) if i is not None)


class HarmonyParser:
    """Reads an answer, fed piece by piece, into reasoning and content pieces and, once each is
    complete, tool calls. The same face as reasoning.ReasoningSplitter (feed, reasoning_text),
    plus `calls`. `funcs`: the offered functions (none: every call's text is content)."""

    def __init__(self, funcs: Optional[dict] = None) -> None:
        self.funcs = funcs or {}
        self.state = "header"  # header: before <|message|>; body: inside a message
        self.held = ""  # header text, or a body tail that may begin a marker
        self.channel, self.recipient = "", None  # the open message's
        self.body: list[str] = []  # a call's text, kept until it closes
        self.reasoning: list[str] = []
        self.wrote = False  # the open message has written reasoning or content
        # a message of that kind was written before: the next one starts with a blank line
        self.apart = {"reasoning": False, "content": False}
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content that `text` decides; `final`: no more text comes."""
        buf, self.held = self.held + text, ""
        out = {"reasoning": "", "content": ""}
        while buf:
            if self.state == "header":
                at = buf.find(MESSAGE)
                if at < 0:
                    self.held, buf = buf, ""
                    break
                self._open(buf[:at])
                buf = buf[at + len(MESSAGE):]
            else:
                cuts = [(i, m) for m in _CLOSERS for i in [buf.find(m)] if i >= 0]
                if cuts:
                    at, marker = min(cuts)
                    self._emit(buf[:at], out)
                    self._close(out)
                    buf = buf[at + len(marker):]
                else:
                    keep = 0 if final else max(_tail_opening(buf, m) for m in MARKUP)
                    self._emit(buf[:len(buf) - keep], out)
                    self.held, buf = buf[len(buf) - keep:], ""
        if final:
            if self.state == "body":  # cut off: the open message ends here
                self._close(out)
            elif CHANNEL not in self.held and START not in self.held and self.held.strip():
                self._write("content", self.held, out)  # no Harmony at all: the text is the answer
            self.held = ""
        if out["reasoning"]:
            self.reasoning.append(out["reasoning"])
        return out["reasoning"], out["content"]

    @property
    def reasoning_text(self) -> Optional[str]:
        """All the reasoning so far; None when the answer had none."""
        return "".join(self.reasoning) if self.reasoning else None

    def _open(self, header: str) -> None:
        header = header.replace(START, "")
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        self.channel = (channel.split() or [""])[0].split("<|")[0]
        m = _RECIPIENT.search(header)
        self.recipient = m.group(1) if m else None
        self.state, self.body, self.wrote = "body", [], False

    def _kind(self) -> str:
        if self.recipient is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"

    def _emit(self, text: str, out: dict) -> None:
        if not text:
            return
        if self._kind() == "call":
            self.body.append(text)
        else:
            self._write(self._kind(), text, out)

    def _write(self, kind: str, text: str, out: dict) -> None:
        if self.apart[kind] and not self.wrote:
            text = "\n\n" + text
        self.wrote = True
        out[kind] += text

    def _close(self, out: dict) -> None:
        """The open message ended (a closer, or the end of the answer)."""
        kind = self._kind()
        if kind == "call":
            call = self._call("".join(self.body))
            if call is not None:
                self.calls.append(call)
            elif self.body:
                self._write("content", "".join(self.body), out)
                kind = "content"
        if self.wrote:
            self.apart[kind] = True
        self.state, self.channel, self.recipient, self.body, self.wrote = "header", "", None, [], False

    def _call(self, text: str) -> Optional[ToolCall]:
        name = self.recipient.removeprefix("functions.") if self.recipient.startswith("functions.") else None
        if name not in self.funcs:
            return None
        try:
            args = json.loads(text)
        except ValueError:
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _tail_opening(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that begins `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


def template_messages(messages: list[dict]) -> list[dict]:
    """An OpenAI conversation (protocol.conversation's dicts) as gpt-oss's template reads it: an
    assistant's earlier reasoning in `thinking`; one call per assistant message (the template
    renders only the first, and names a tool result after the call before it), each call's
    result right after it, matched by tool_call_id; where an assistant message with calls has
    both reasoning and content, the reasoning (the template refuses both)."""
    results = {m.get("tool_call_id"): m for m in messages if m["role"] == "tool" and m.get("tool_call_id")}
    placed: set[int] = set()
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            if id(m) not in placed:
                out.append(m)
            continue
        if m["role"] != "assistant":
            out.append(m)
            continue
        m = dict(m)
        thinking = m.pop("reasoning_content", None)
        if thinking:
            m["thinking"] = thinking
        calls = m.pop("tool_calls", None) or []
        if not calls:
            out.append(m)
            continue
        if thinking:
            m["content"] = ""
        for i, call in enumerate(calls):
            one = dict(m, tool_calls=[call]) if i == 0 else {"role": "assistant", "content": "", "tool_calls": [call]}
            out.append(one)
            result = results.get(call.get("id"))
            if result is not None and len(calls) > 1:
                out.append(result)
                placed.add(id(result))
    return out
