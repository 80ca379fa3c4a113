"""Request and response bodies of the OpenAI-compatible API (the subset SpecPipe serves).

Fields a client may send that change nothing here (user, metadata, ...) are ignored, as OpenAI's
own server does; fields that would change the output but are not supported (n > 1, logprobs,
penalties, tools, ...) are refused with a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Stop strings are matched on the engine thread after every token of the request, so their number
# and length are bounded: 4 as OpenAI allows, and 256 characters (longer than any useful stop,
# short enough that the tail scanned per token stays small).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """What completions and chat share."""

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension (as vLLM): 0 or -1 = off
    ignore_eos: bool = False  # extension (as vLLM): decode up to max_tokens whatever the model says
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    stop: Optional[Union[str, list[str]]] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # Refused unless left at their no-op values (see unsupported()).
    logprobs: Optional[Any] = None
    top_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    best_of: Optional[int] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stops

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(field, why) for the first field set to something this server cannot do."""
        checks = [("n", self.n != 1, "only n = 1 is supported"),
                  ("best_of", self.best_of not in (None, 1), "best_of is not supported"),
                  ("logprobs", self.logprobs not in (None, False, 0), "logprobs are not supported"),
                  ("top_logprobs", bool(self.top_logprobs), "logprobs are not supported"),
                  ("presence_penalty", self.presence_penalty != 0, "penalties are not supported"),
                  ("frequency_penalty", self.frequency_penalty != 0, "penalties are not supported"),
                  ("logit_bias", bool(self.logit_bias), "logit_bias is not supported")]
        return next(((f, why) for f, bad, why in checks if bad), None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()

    def single_prompt(self) -> Union[str, list[int]]:
        """The one prompt (a list holding one prompt is accepted too); ValueError otherwise."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(p)}")
            p = p[0]
        if not p:
            raise ValueError("the prompt is empty")
        return p


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[Any]] = None
    response_format: Optional[dict] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.tools:
            return "tools", "tool calls are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "structured output is not supported"
        return super().unsupported()

    def conversation(self) -> list[dict]:
        # "developer" is OpenAI's newer name for the system role.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# -- responses ----------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    """A whole completion, or (object "text_completion" as OpenAI streams it) one chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specpipe"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok", "unhealthy"]
    error: Optional[str] = None  # why it cannot serve (unhealthy only)
