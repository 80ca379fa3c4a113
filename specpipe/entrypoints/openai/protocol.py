"""Request and response bodies of the OpenAI-compatible API (the subset SpecPipe serves).

Fields a client may send that change nothing here (user, metadata, ...) are ignored, as OpenAI's
own server does; fields that would change the output but are not supported (suffix, chat's
best_of, ...) are refused with a 400 naming the field, never silently dropped.

Logprobs (completions' `logprobs: k`, chat's `logprobs: true` + `top_logprobs: k`, k <= 20; echo's
and `prompt_logprobs` for the prompt) are the target's raw log-probabilities, before temperature,
top-p, min_p, penalties and logit_bias (vLLM's default), identical in every mode: see
sampling.target_logprobs. n, echo, penalties: docs/api.md.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

from specpipe.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_TOKENS, MAX_TOP_K

# Stop strings are matched after every token of the request (on the output thread), so what a
# request may give is bounded by their total size, not their number (vLLM takes any number; so
# do we, within MAX_STOP_TOTAL_CHARS): each token costs a scan of a tail about as long as the
# longest, once per string. Checked before the type (`_stops_checked`), so a 400 names the cause.
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 1024  # one string
MAX_STOP_TOTAL_CHARS = 16384  # all of a request's strings together


def _stops_checked(v: Any) -> Any:
    if v is None or isinstance(v, str):
        v = [] if v is None else [v]
    if not isinstance(v, list):
        raise ValueError(f"stop must be a string or a list of strings, not {type(v).__name__}")
    for i, x in enumerate(v):
        if not isinstance(x, str):
            raise ValueError(f"stop[{i}] must be a string, not {type(x).__name__}")
        if not x:
            raise ValueError(f"stop[{i}] is empty")
        if len(x) > MAX_STOP_CHARS:
            raise ValueError(f"stop[{i}] has {len(x)} characters, at most {MAX_STOP_CHARS} are allowed")
    if len(v) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(v)} stop strings, at most {MAX_STOP_STRINGS} are allowed")
    total = sum(map(len, v))
    if total > MAX_STOP_TOTAL_CHARS:
        raise ValueError(f"the stop strings have {total} characters in all, at most {MAX_STOP_TOTAL_CHARS} "
                         f"are allowed")
    return v


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
# Published as OpenAI's (a string, or a list of them); always read as a list.
Stops = Annotated[Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]],
                  BeforeValidator(_stops_checked)]


def _a_number(v: Any) -> Any:
    # Pydantic's lax mode reads true/false as 1/0 and "7" as 7; the schema says number, so a
    # boolean or a string is refused (an integral float such as 1.0 is a JSON integer and passes).
    if isinstance(v, (bool, str)):
        raise ValueError(f"a number is expected, not a {type(v).__name__}")
    return v


def Num(kind: type, **bounds: Any) -> Any:
    """A number field: `kind` with `bounds` (ge, le, ...) that the published schema shows."""
    return Annotated[kind, Field(**bounds), BeforeValidator(_a_number)]


Int, Float = Num(int), Num(float)
TokenId = Num(int, ge=0)  # below the vocabulary's size too (the served schema says; checked with the model)


def Only(default: Any, accepted: dict) -> Any:
    """A field this server cannot act on (n > 1, logprobs, penalties, ...): the schema publishes
    the no-op values it accepts (`accepted`, JSON schema keywords), while `unsupported()` answers
    any other value with a 400 that says why, rather than pydantic's generic message."""
    return Field(default=default, json_schema_extra=accepted)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    schema_: Union[dict, bool] = Field(alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None  # with type json_schema


class FunctionDef(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema; none: no arguments
    strict: Optional[StrictBool] = None


class ToolDef(OpenAIModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


Text = Annotated[str, Field(min_length=1)]


# The schema carries bounds as floats, and above 2**53 a float bound is not the integer it means
# (a generator then finds seeds the schema allows and the model refuses): seeds are integers a
# double holds exactly, as JavaScript clients can send them anyway.
MAX_SEED = 2**53
MAX_TOOLS = 128  # as OpenAI allows
MAX_N = 16  # samples one request may ask for (each is a request of its own in the engine)
MAX_PROMPTS = 32  # prompts one completions request may hold (each a request of its own in the engine)
MAX_CHOICES = 64  # prompts x n in one completions request


class SamplingFields(OpenAIModel):
    """What completions and chat share. Every number is bounded here, and so in the published
    schema (sampling.py says why): a value the engine cannot use is a 400 at parsing, never a
    failed step. max_tokens is bounded by the model's context too (in the schema the server
    publishes, and checked with the prompt)."""

    model: str = Field(max_length=256)
    max_tokens: Optional[Num(int, ge=1, le=MAX_TOKENS)] = None
    temperature: Num(float, ge=0.0, le=2.0) = 1.0
    top_p: Num(float, gt=0.0, le=1.0) = 1.0
    top_k: Num(int, ge=-1, le=MAX_TOP_K) = 0  # extension (as vLLM): 0 or -1 = off
    ignore_eos: StrictBool = False  # extension (as vLLM): decode up to max_tokens whatever the model says
    seed: Optional[Num(int, ge=0, le=MAX_SEED)] = None
    stop: Optional[Stops] = None  # a string or a list of them (read as a list)
    # n samples, each its own request (seeds: samples.py), sharing the prompt's prefill.
    n: Num(int, ge=1, le=MAX_N) = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    # Penalties and biases, vLLM's semantics (specpipe/penalties.py), exact under speculation.
    presence_penalty: Num(float, ge=-2.0, le=2.0) = 0.0
    frequency_penalty: Num(float, ge=-2.0, le=2.0) = 0.0
    repetition_penalty: Num(float, gt=0.0, le=MAX_REPETITION_PENALTY) = 1.0  # extension (as vLLM)
    min_p: Num(float, ge=0.0, le=1.0) = 0.0  # extension (as vLLM)
    # {token id (as a string): bias in [-100, 100]}, as OpenAI's
    logit_bias: Optional[Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,18}$")], Num(float, ge=-100.0, le=100.0)],
                                   Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})]] = None
    best_of: Optional[Int] = Only(None, {"enum": [None, 1]})  # chat: refused unless left at its no-op value
    # vLLM's: each prompt token's log-probability (the first null) and the top k at its place,
    # as choices[].prompt_logprobs (completions) or prompt_logprobs (chat): {token id: Logprob}
    prompt_logprobs: Optional[Num(int, ge=0, le=MAX_LOGPROBS)] = None
    # Structured output (specpipe/grammar/): OpenAI's response_format, and vLLM's extras.
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[dict, Text]] = None
    guided_regex: Optional[Text] = None
    guided_grammar: Optional[Text] = None  # Lark or GBNF (llama.cpp's grammars)

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(field, why) for the first field set to something this server cannot do."""
        if self.best_of not in (None, 1):
            return "best_of", "best_of is served on /v1/completions only"
        return None

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprobs_asked(self) -> Optional[int]:
        """How many top log-probabilities each token gets (0: its own only); None: none."""
        return None

    def prompt_logprobs_asked(self) -> Optional[int]:
        return self.prompt_logprobs


Logprobs = Num(int, ge=0, le=MAX_LOGPROBS)


def _prompt_count_checked(v: Any) -> Any:
    """Before the union's type check, so that too many prompts is a 400 that says so."""
    if isinstance(v, list) and len(v) > MAX_PROMPTS and all(isinstance(x, (str, list)) for x in v):
        raise ValueError(f"{len(v)} prompts, at most {MAX_PROMPTS} are allowed in one request")
    return v


class CompletionRequest(SamplingFields):
    # A prompt (text or token ids), or a list of up to MAX_PROMPTS of them (lm-evaluation-harness
    # sends batch_size of them): each is sampled as if sent alone, its n choices at index j * n + i.
    prompt: Annotated[Union[Annotated[str, Field(min_length=1)], Annotated[list[TokenId], Field(min_length=1)],
                            Annotated[list[Annotated[str, Field(min_length=1)]],
                                      Field(min_length=1, max_length=MAX_PROMPTS)],
                            Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                                      Field(min_length=1, max_length=MAX_PROMPTS)]],
                      BeforeValidator(_prompt_count_checked)]
    echo: StrictBool = False  # the prompt before the completion (with logprobs: the prompt's too, the first null)
    max_tokens: Optional[Num(int, ge=0, le=MAX_TOKENS)] = None  # 0: the prompt only (with echo)
    suffix: Optional[str] = Only(None, {"maxLength": 0})
    logprobs: Optional[Logprobs] = None  # the top k of each token's position (OpenAI's legacy shape)
    # best_of samples (seeds as n's), of which the n with the highest cumulative log-probability
    # are returned (vLLM's and OpenAI's); not streamed when over n (samples.py)
    best_of: Optional[Num(int, ge=1, le=MAX_N)] = None

    @property
    def samples(self) -> int:
        """How many samples each prompt gets in the engine: best_of (at least n)."""
        return self.best_of or self.n

    def logprobs_asked(self) -> Optional[int]:
        return self.logprobs

    def prompt_logprobs_asked(self) -> Optional[int]:
        """The prompt's top count the engine computes: echo's (with logprobs) or prompt_logprobs'."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 is allowed with echo only"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None:
            if self.best_of < self.n:
                return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"
            if self.stream and self.best_of > self.n:
                return "best_of", (f"best_of ({self.best_of}) over n ({self.n}) is not streamed: the best are "
                                   f"known only once every sample is done (ask for a whole response)")
            return None
        return super().unsupported()

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, one or several; ValueError when one is empty or prompts x n is over MAX_CHOICES."""
        p = self.prompt
        prompts = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if any(not q for q in prompts):
            raise ValueError("the prompt is empty")
        if len(prompts) * self.samples > MAX_CHOICES:
            what = f"best_of = {self.best_of} is {len(prompts) * self.samples} samples" if self.best_of \
                else f"n = {self.n} is {len(prompts) * self.n} choices"
            raise ValueError(f"{len(prompts)} prompts x {what}, over {MAX_CHOICES}")
        return prompts


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(OpenAIModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant's earlier calls
    reasoning_content: Optional[str] = None  # an assistant's earlier reasoning, for templates that read it
    tool_call_id: Optional[str] = None  # a tool's answer: to which call
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Num(int, ge=1, le=MAX_TOKENS)] = None
    tools: Optional[Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None  # accepted; a model may write several calls either way
    logprobs: Optional[StrictBool] = None  # each output token's log-probability in choices[].logprobs.content
    top_logprobs: Optional[Logprobs] = None  # and the top k at its position (needs logprobs: true)
    # vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # OpenAI's, for reasoning models: reaches the template as reasoning_effort (gpt-oss's reads it)
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = None

    def logprobs_asked(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def conversation(self) -> list[dict]:
        # "developer" is OpenAI's newer name for the system role.
        out = []
        for m in self.messages:
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [_call_for_template(c.model_dump()) for c in m.tool_calls]
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


def _call_for_template(call: dict) -> dict:
    """An earlier call as chat templates read it: arguments as an object, where they parse."""
    f = dict(call["function"])
    try:
        f["arguments"] = json.loads(f["arguments"])
    except ValueError:
        pass
    return {**call, "function": f}


# -- responses ----------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """A completion's log-probabilities (OpenAI's legacy shape): per token its text, its
    log-probability, {text: log-probability} of the top k (and the token), its offset in the text."""

    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    text_offset: list[int] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class Choice(BaseModel):
    """What every choice carries besides its text (a completion's, a message or a delta)."""

    index: int = 0
    logprobs: Optional[Union[CompletionLogprobs, ChatLogprobs]] = None  # when asked
    finish_reason: Optional[str] = None


class Response(BaseModel):
    """What every response and chunk carries besides its choices; each kind fixes `object`."""

    id: str
    object: str
    created: int = Field(default_factory=now)
    model: str


class PromptLogprob(BaseModel):
    """vLLM's Logprob of one prompt token's entry: rank among the top k (null outside them)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: str


PromptLogprobs = Optional[list[Optional[dict[str, PromptLogprob]]]]


class CompletionChoice(Choice):
    text: str
    prompt_logprobs: PromptLogprobs = None  # when asked (vLLM's prompt_logprobs)


class CompletionResponse(Response):
    """A whole completion, or (object "text_completion" as OpenAI streams it) one chunk of one."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    reasoning_content: Optional[str] = None  # <think>…</think> (reasoning.py), as vLLM returns it
    tool_calls: Optional[list[dict]] = None


class ChatChoice(Choice):
    message: AssistantMessage


class ChatCompletionResponse(Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs = None  # when asked (vLLM's prompt_logprobs)


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict]] = None


class ChatChunkChoice(Choice):
    delta: DeltaMessage


class ChatCompletionChunk(Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    """One served name, as OpenAI lists a model (id, object, created, owned_by) with vLLM's
    extras (root: the weights it serves, parent, max_model_len, permission)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specpipe"
    root: str
    parent: Optional[str] = None
    max_model_len: int
    permission: list[dict] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's /tokenize and /detokenize -------------------------------------------------------------------
class TokenizeRequest(OpenAIModel):
    """A plain prompt, or chat messages rendered by the model's template (as vLLM's /tokenize):
    exactly one of the two, which the served schema says too (oneOf)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "oneOf": [{"required": ["prompt"], "not": {"required": ["messages"]}},
                  {"required": ["messages"], "not": {"required": ["prompt"]}}]})

    model: Optional[str] = Field(default=None, max_length=256)
    prompt: str = None  # type: ignore[assignment]  (not nullable in the schema: absent or a string)
    messages: list[ChatMessage] = Field(default=None, min_length=1)  # type: ignore[assignment]
    add_special_tokens: Optional[StrictBool] = None  # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True  # messages only
    return_token_strs: StrictBool = False

    def conversation(self) -> list[dict]:
        return ChatCompletionRequest(model="", messages=self.messages).conversation()


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = Field(default=None, max_length=256)
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's GET /tokenizer_info, the fields its clients read (no pad token of its own: the EOS,
    as the server pads nothing)."""

    tokenizer_class: str = "specpipe"
    eos_token: Optional[str] = None
    bos_token: Optional[str] = None
    pad_token: Optional[str] = None
    chat_template: Optional[str] = None
    model_max_length: int


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
    stages: Optional[list[dict]] = None  # each stage's node, layers, state and restarts
    kernels: Optional[dict] = None  # the kernel per weight type and the native ISA (Engine.kernel_report)
