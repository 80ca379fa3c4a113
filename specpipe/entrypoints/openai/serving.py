"""The completions and chat endpoints: request body -> engine Request -> response or SSE stream.

    body --validate--> prompt ids + SamplingParams --AsyncEngine.add--> RequestStream
         --Deltas--> one JSON response, or server-sent events (OpenAI's chunk format, [DONE] last)

Everything a client can get wrong becomes an ApiError (status + OpenAI error body) before the
request reaches the engine; what goes wrong inside it (a stage failed) becomes a 5xx.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Sequence, Union

from specpipe.config import ConfigError
from specpipe.engine.async_engine import AdmitFailed, AsyncEngine, Delta, EngineDead, EngineStalled, RequestStream
from specpipe.engine.engine import Engine
from specpipe.engine.prompts import PromptError
from specpipe.entrypoints.openai import protocol as p
from specpipe.entrypoints.openai.harmony import HarmonyParser, harmony_ids, speaks_harmony, template_messages
from specpipe.entrypoints.openai.harmony_grammar import call_constraint, harmony_constraint
from specpipe.entrypoints.openai.samples import Samples, add_samples, merged_events, sample_seed
from specpipe.entrypoints.openai.reasoning import ReasoningSplitter, prompt_opens_thinking
from specpipe.entrypoints.openai.structured import BadConstraint, constraint_of, param_of
from specpipe.entrypoints.openai.tool_formats import OPENERS as FAMILY_OPENERS, markup_ids
from specpipe.entrypoints.openai.tools import (FENCE, TOOL_TAG, ToolCall, check_tools, forced_constraint,
                                               parse_tool_calls, tools_prompt)
from specpipe.grammar import GrammarSpecError, StructuredOutput
from specpipe.sampling import SamplingParams, TokenLogprobs
from specpipe.tokenizer.tokenizer import TokenizerError
from specpipe.sched.scheduler import QueueFull

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
TOKENIZE_THREADS = 2  # prompts tokenized at once, off the event loop (each holds a core while it works)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))


class OpenAIServing:
    def __init__(self, engine: Engine, aengine: AsyncEngine, model_names: Union[str, Sequence[str]],
                 fenced_tool_calls: bool = True) -> None:
        """`model_names`: every name clients may use (--served-model-name takes several); the
        first is the one metrics and logs use. Responses name the model as the request did.
        `fenced_tool_calls`: in tool_choice auto, read a ```json fenced call too (tools.py)."""
        names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"served model names must be distinct and at least one, got {list(names)}")
        self.engine, self.aengine, self.model_names = engine, aengine, names
        self.model_name = names[0]
        self.fenced_tool_calls = fenced_tool_calls
        self.harmony = speaks_harmony(engine.tokenizer)  # gpt-oss: answers in channels (harmony.py)
        # special tokens a chat answer keeps: the markup the server reads (tool_formats.py, harmony.py)
        harmony_markup = harmony_ids(engine.tokenizer) if self.harmony else frozenset()
        self.markup_ids = markup_ids(engine.tokenizer) | harmony_markup
        # Tokenizing and rendering the chat template take time in proportion to the body: on the
        # event loop, one big prompt would stall every other stream.
        self._tokenize = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="specpipe-tokenize")
        # Constraints compile one at a time in a child process, each within its deadline
        # (grammar/sandbox.py): their own thread, so a slow one never holds up tokenizing.
        self._compile = ThreadPoolExecutor(1, thread_name_prefix="specpipe-grammar")

    async def _off_loop(self, fn, *args, pool: Optional[ThreadPoolExecutor] = None):
        return await asyncio.get_running_loop().run_in_executor(pool or self._tokenize, fn, *args)

    def close(self) -> None:
        """Stop the threads and the grammar compiler's child (a compilation in progress ends
        at once, so shutdown never waits for one)."""
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        self._compile.shutdown(wait=False, cancel_futures=True)
        self.engine.prompts.close()

    def models(self) -> p.ModelList:
        root = str(self.engine.model_path)
        return p.ModelList(data=[p.ModelCard(id=name, root=root, max_model_len=self.engine.max_context)
                                 for name in self.model_names])

    # -- vLLM's /tokenize, /detokenize and /tokenizer_info --------------------------------------------
    def tokenizer_info(self) -> p.TokenizerInfo:
        """What a client needs to tokenize through /tokenize (lm-evaluation-harness's remote
        tokenizer reads the special tokens' texts and the chat template from it)."""
        tok = self.engine.tokenizer
        return p.TokenizerInfo(eos_token=tok.eos_token, bos_token=tok.bos_token, pad_token=tok.eos_token,
                               chat_template=tok.chat_template, model_max_length=self.engine.max_context)

    async def tokenize(self, body: p.TokenizeRequest) -> p.TokenizeResponse:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        tok = self.engine.tokenizer

        def encode() -> list[int]:
            if body.prompt is not None:
                return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
            text = tok.apply_chat_template(body.conversation(), add_generation_prompt=body.add_generation_prompt)
            return tok.encode(text, add_special_tokens=bool(body.add_special_tokens))  # the template holds them

        try:
            ids = await self._off_loop(encode)
        except (ConfigError, TokenizerError) as e:
            raise ApiError(400, str(e), param="messages" if body.messages else "prompt") from None
        # token_strs: each token's own text, decoded alone (special tokens kept)
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_context, tokens=ids, token_strs=strs)

    async def detokenize(self, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self._check_model(body.model)
        vocab = self.engine.prompts.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside this model's vocabulary of {vocab}", param="tokens")
        return p.DetokenizeResponse(prompt=await self._off_loop(self.engine.tokenizer.decode, body.tokens))

    def _check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.model_names:
            served = ", ".join(map(repr, self.model_names))
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    # -- admission ----------------------------------------------------------------------------------
    async def completion_stream(self, body: p.CompletionRequest,
                                client: Optional[str] = None) -> Union[RequestStream, Samples]:
        self._check(body)
        try:
            prompts = body.prompts()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from None
        ids = [await self._prompt_ids(prompt) for prompt in prompts]  # every 400 before anything is queued
        structured = await self._constraint(body)
        if len(prompts) == 1:
            return await self._completion_samples(body, prompts[0], ids[0], structured, client)
        # Several prompts: each sampled as if sent alone (its own n, its seeds), choices j * n + i.
        added = await asyncio.gather(*[self._completion_samples(body, prompt, prompt_ids, structured, client, j)
                                       for j, (prompt, prompt_ids) in enumerate(zip(prompts, ids))],
                                     return_exceptions=True)
        streams = [s for a in added if not isinstance(a, BaseException)
                   for s in (a.streams if isinstance(a, Samples) else [a])]
        failed = next((a for a in added if isinstance(a, BaseException)), None)
        if failed is not None:
            Samples(streams).cancel()
            raise failed
        return Samples(streams)

    async def _prompt_ids(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return await self._off_loop(self.engine.tokenizer.encode, prompt)
        if len(prompt) > self.engine.max_context:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens, over this model's context of "
                                f"{self.engine.max_context}", param="prompt", code="context_length_exceeded")
        return list(prompt)

    async def _completion_samples(self, body: p.CompletionRequest, prompt: Union[str, list[int]], ids: list[int],
                                  structured: Optional[StructuredOutput], client: Optional[str],
                                  prompt_index: int = 0) -> Union[RequestStream, Samples]:
        """One prompt's n samples (or its one stream)."""
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        echo = (prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)) if body.echo else None
        # best_of over n: the samples are ranked by their tokens' log-probabilities (_best), which
        # the engine then computes whether the client asked for them or not (and shows them only if so)
        ranked = body.samples > body.n

        async def add(i: int) -> RequestStream:
            # max_tokens 0 (with echo): the prompt alone; the engine still decodes one token, unshown
            stream = await self._add(ids, body, max(1, max_tokens), client, structured, i, rank=ranked)
            stream.echo, stream.hide_output, stream.show_prompt_logprobs = echo, max_tokens == 0, body.prompt_logprobs
            stream.prompt_index = prompt_index  # usage counts each prompt once (_usage)
            stream.keep = body.n  # of the prompt's samples, the n best are returned (_best)
            stream.hide_logprobs = body.logprobs is None
            return stream

        return await self._samples(body, add, body.samples)

    async def chat_stream(self, body: p.ChatCompletionRequest, client: Optional[str] = None) -> RequestStream:
        self._check(body)
        try:
            funcs, choice = check_tools(_dumped(body.tools), _dumped(body.tool_choice))
            forced = (call_constraint if self.harmony else forced_constraint)(funcs, choice)
        except BadConstraint as e:
            raise ApiError(400, str(e), param=e.param) from None
        structured = await self._constraint(body, forced, harmony=self.harmony)
        ids = await self._chat_prompt(body, funcs, choice)
        # Without a limit a chat answer may use the rest of the context.
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, self.engine.max_context - len(ids))
        if body.n > 1 and body.stream and funcs and choice != "none":
            raise ApiError(400, "n > 1 is not streamed with tools (ask for whole responses)", param="n",
                           code="unsupported_parameter")

        async def add(i: int) -> RequestStream:
            stream = await self._add(ids, body, max_tokens, client, structured, i, keep_special=self.markup_ids)
            stream.tool_funcs = funcs if choice != "none" else None  # answers are read for calls (tools.py)
            stream.fenced_calls = self.fenced_tool_calls
            stream.reasoning = self._reasoning(ids, funcs if choice != "none" else None)
            return stream

        return await self._samples(body, add)

    @staticmethod
    async def _samples(body: p.SamplingFields, add, count: Optional[int] = None) -> Union[RequestStream, Samples]:
        """One stream, or for n > 1 (or `count`, completions' best_of) the samples' (samples.py)."""
        count = count or body.n
        return await add(0) if count == 1 else await add_samples(count, add)

    async def _chat_prompt(self, body: p.ChatCompletionRequest, funcs: dict, choice: str) -> list[int]:
        """The prompt's ids: the template over the messages with chat_template_kwargs, and the
        offered tools (as a system message where the template cannot render them)."""
        conversation = body.conversation()
        if self.harmony:
            conversation = template_messages(conversation)
        tools = _dumped(body.tools) if funcs and choice != "none" else None
        if tools and not self.engine.tokenizer.renders_tools:
            conversation = [{"role": "system", "content": tools_prompt(tools)}, *conversation]  # template cannot
            tools = None
        kwargs = body.chat_template_kwargs or {}
        if "messages" in kwargs:
            raise ApiError(400, "chat_template_kwargs may not set messages", param="chat_template_kwargs")
        if body.reasoning_effort is not None and "reasoning_effort" not in kwargs:  # gpt-oss's template reads it
            kwargs = {**kwargs, "reasoning_effort": body.reasoning_effort}
        try:
            return await self._off_loop(lambda: self.engine.prompts.encode_chat(conversation, tools, kwargs))
        except (ConfigError, TokenizerError) as e:  # no template, or the template refused these messages
            raise ApiError(400, str(e), param="messages") from None

    async def count_chat_tokens(self, body: p.ChatCompletionRequest) -> int:
        """The tokens a chat request's prompt would hold (Anthropic's count_tokens), nothing queued."""
        self._check_model(body.model)
        try:
            funcs, choice = check_tools(_dumped(body.tools), _dumped(body.tool_choice))
        except BadConstraint as e:
            raise ApiError(400, str(e), param=e.param) from None
        return len(await self._chat_prompt(body, funcs, choice))

    def _reasoning(self, prompt_ids: list[int],
                   funcs: Optional[dict] = None) -> Union[ReasoningSplitter, HarmonyParser, None]:
        """A reasoning model's answer is read for <think>…</think> (reasoning.py); its prompt
        may have opened the <think> already (DeepSeek-R1's template does). gpt-oss's is read
        for its channels, calls of `funcs` among them (harmony.py)."""
        if self.harmony:
            return HarmonyParser(funcs)
        tok = self.engine.tokenizer
        if not tok.reasons:
            return None
        return ReasoningSplitter(prompt_opens_thinking(tok.decode(prompt_ids[-8:], skip_special_tokens=False)))

    async def _constraint(self, body: p.SamplingFields, forced: Optional[StructuredOutput] = None,
                          harmony: bool = False) -> Optional[StructuredOutput]:
        """The body's output constraint, compiled (off the event loop, cached) so that one that
        does not compile is a 400 naming the field, before anything is queued. `harmony`: a
        JSON one holds the final channel only (harmony_grammar.py)."""
        try:
            structured = constraint_of(body, forced)
            structured = harmony_constraint(structured) if harmony else structured
        except BadConstraint as e:
            raise ApiError(400, str(e), param=e.param) from None
        if structured is not None:
            try:
                await self._off_loop(self.engine.prompts.grammars.compile, structured, pool=self._compile)
            except GrammarSpecError as e:
                raise ApiError(400, f"the output constraint does not compile: {e}",
                               param=param_of(body, forced is not None)) from None
        return structured

    def _check(self, body: p.SamplingFields) -> None:
        """What can be refused before any tokenizing."""
        self._check_model(body.model)
        bad = body.unsupported()
        if bad is not None:
            raise ApiError(400, bad[1], param=bad[0], code="unsupported_parameter")
        context = self.engine.max_context
        for name in ("max_tokens", "max_completion_tokens"):
            n = getattr(body, name, None)
            if n is not None and n > context:
                raise ApiError(400, f"{name} is {n}, over this model's context of {context} tokens", param=name,
                               code="context_length_exceeded")

    async def _add(self, prompt_ids: list[int], body: p.SamplingFields, max_tokens: int,
                   client: Optional[str], structured: Optional[StructuredOutput] = None, sample: int = 0,
                   keep_special: frozenset[int] = frozenset(), rank: bool = False) -> RequestStream:
        """Sample `sample` of the body's n (its seed: samples.sample_seed). `keep_special`: special
        tokens whose text stays in the output (tool-call and reasoning markup). `rank`: the
        tokens' own log-probabilities are computed even if the body did not ask (best_of)."""
        if self.aengine.dead is not None:
            raise ApiError(503, f"the engine cannot serve: {self.aengine.dead}", "server_error", code="engine_dead")
        context = self.engine.max_context
        if len(prompt_ids) + max_tokens > context:
            raise ApiError(400, f"this model's context is {context} tokens, but {len(prompt_ids) + max_tokens} were "
                                f"requested ({len(prompt_ids)} in the prompt, {max_tokens} in the completion); "
                                f"shorten the prompt or lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")
        try:
            sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                                      seed=sample_seed(body.seed, sample), max_tokens=max_tokens, stop=tuple(body.stop or ()),
                                      structured=structured,
                                      logprobs=0 if rank and body.logprobs_asked() is None else body.logprobs_asked(),
                                      presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                      repetition_penalty=body.repetition_penalty, min_p=body.min_p,
                                      logit_bias=body.logit_bias_pairs(), prompt_logprobs=body.prompt_logprobs_asked())
            req = self.engine.prompts.make_request(prompt_ids, sampling, ignore_eos=body.ignore_eos,
                                                   keep_special=keep_special)
        except PromptError as e:  # empty, or token ids outside the vocabulary (the prompt's or logit_bias's)
            raise ApiError(400, str(e), param="logit_bias" if "logit_bias" in str(e) else "prompt") from None
        except ValueError as e:  # ConfigError included
            raise ApiError(400, str(e)) from None
        req.client = client  # fair admission across API keys / client addresses
        try:
            stream = await self.aengine.add(req)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full") from None
        except EngineDead as e:
            raise ApiError(503, f"the engine cannot serve: {e}", "server_error", code="engine_dead") from None
        except EngineStalled as e:
            raise ApiError(503, f"the server is not answering: {e}", "server_error", code="engine_stalled") from None
        except AdmitFailed as e:
            raise ApiError(500, str(e), "server_error", code="engine_error") from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        stream.model = body.model  # the name the client used (one of the served names)
        return stream

    # -- whole responses -----------------------------------------------------------------------------
    async def completion(self, stream: Union[RequestStream, Samples]) -> p.CompletionResponse:
        every = await _drain_all(stream)
        done = _best(every)
        choices = []
        for i, s in enumerate(done):
            lps = Logprobs(self.engine.tokenizer, s, echo=s.echo is not None)
            choices.append(p.CompletionChoice(index=i, text=(s.echo or "") + ("" if s.hide_output else s.text),
                                              finish_reason=s.finish_reason, logprobs=lps.completion(_shown(s)),
                                              prompt_logprobs=lps.prompt(s.show_prompt_logprobs)))
        return p.CompletionResponse(id=p.new_id("cmpl"), model=stream.model, usage=_usage(*every), choices=choices)

    async def chat(self, stream: Union[RequestStream, Samples]) -> p.ChatCompletionResponse:
        done = await _drain_all(stream)
        choices = []
        for i, s in enumerate(done):
            reasoning, text = _split_reasoning(s)
            content, calls = _answer(s, text)
            message = p.AssistantMessage(content=content, reasoning_content=reasoning,
                                         tool_calls=[c.as_openai() for c in calls] or None)
            lps = Logprobs(self.engine.tokenizer, s)
            choices.append(p.ChatChoice(index=i, message=message, finish_reason="tool_calls" if calls else s.finish_reason,
                                        logprobs=lps.chat(len(s.token_ids))))
        return p.ChatCompletionResponse(id=p.new_id("chatcmpl"), model=stream.model, usage=_usage(*done),
                                        choices=choices, prompt_logprobs=Logprobs(self.engine.tokenizer, done[0]).prompt(
                                            done[0].req.sampling.prompt_logprobs))

    # -- streams ----------------------------------------------------------------------------------------
    def completion_events(self, stream: Union[RequestStream, Samples], include_usage: bool,
                          rid: Optional[str] = None) -> AsyncIterator[str]:
        rid = rid or p.new_id("cmpl")
        if isinstance(stream, Samples):
            return merged_events(stream, [self.completion_events(s, False, rid) for s in stream.streams],
                                 include_usage and (lambda: _sse(p.CompletionResponse(
                                     id=rid, model=stream.model, choices=[], usage=_usage(*stream.streams)).model_dump_json())))
        lps = Logprobs(self.engine.tokenizer, stream, echo=stream.echo is not None)
        first = [True]  # the first chunk carries the echo and the prompt logprobs (once the prompt is computed)

        def chunk(d: Optional[Delta], usage: Optional[p.UsageInfo] = None) -> p.CompletionResponse:
            choices = []
            if d is not None:
                text = ("" if stream.hide_output else d.text)
                prompt_lps = lps.prompt(stream.show_prompt_logprobs) if first[0] else None
                if first[0] and stream.echo:
                    text = stream.echo + text
                first[0] = False
                choices = [p.CompletionChoice(text=text, finish_reason=d.finish_reason,
                                              logprobs=lps.completion(_shown(stream)), prompt_logprobs=prompt_lps)]
            return p.CompletionResponse(id=rid, model=stream.model, choices=choices, usage=usage)

        return _events(stream, include_usage, chunk, first=None)

    def chat_events(self, stream: Union[RequestStream, Samples], include_usage: bool,
                    rid: Optional[str] = None) -> AsyncIterator[str]:
        rid = rid or p.new_id("chatcmpl")
        if isinstance(stream, Samples):
            return merged_events(stream, [self.chat_events(s, False, rid) for s in stream.streams],
                                 include_usage and (lambda: _sse(p.ChatCompletionChunk(
                                     id=rid, model=stream.model, choices=[], usage=_usage(*stream.streams)).model_dump_json())))
        lps = Logprobs(self.engine.tokenizer, stream)

        def chunk(d: Optional[Delta], usage: Optional[p.UsageInfo] = None) -> p.ChatCompletionChunk:
            choices = [] if d is None else [p.ChatChunkChoice(
                delta=_delta(stream, d), finish_reason=d.finish_reason, logprobs=lps.chat(len(stream.token_ids)))]
            return p.ChatCompletionChunk(id=rid, model=stream.model, choices=choices, usage=usage)

        # OpenAI opens a chat stream with the assistant's role and empty content.
        first = p.ChatCompletionChunk(id=rid, model=stream.model, choices=[p.ChatChunkChoice(
            delta=p.DeltaMessage(role="assistant", content=""))])
        if getattr(stream, "tool_funcs", None):
            return _tool_events(stream, include_usage, rid, stream.model, first, lps)
        return _events(stream, include_usage, chunk, first)


Chunk = Union[p.CompletionResponse, p.ChatCompletionChunk]


async def _events(stream: RequestStream, include_usage: bool, chunk: Callable[..., Chunk],
                  first: Optional[Chunk]) -> AsyncIterator[str]:
    """Server-sent events of one request: a chunk per delivered piece, the finish reason in the
    last, then usage (when asked) and [DONE]. A request that fails mid-stream gets an error event.
    However the stream ends (the client may leave at any point), the request is cancelled."""
    try:
        if first is not None:
            yield _sse(first.model_dump_json())
        async for d in stream:
            if d.finish_reason in ("error", "abort"):
                yield _sse(_failure(stream).body.model_dump_json())
                break
            if d.text or d.finish_reason is not None or (d.token_ids and stream.req.sampling.logprobs is not None):
                yield _sse(chunk(d).model_dump_json())  # tokens whose text is held back still bring logprobs
        else:
            if include_usage:
                yield _sse(chunk(None, _usage(stream)).model_dump_json())
        yield _sse("[DONE]")
    finally:
        stream.cancel()


async def _tool_events(stream: RequestStream, include_usage: bool, rid: str, model: str,
                       first: p.ChatCompletionChunk, lps: "Logprobs") -> AsyncIterator[str]:
    """A chat stream that may end in tool calls. Text streams as content while it cannot be the
    start of a call; from a `<tool_call>` tag (or an answer that opens with JSON, Llama 3's calls)
    it is held until the end, since a call is only known once its JSON is complete. Then the
    calls go out as one delta each (index, id, name, arguments), which the openai client
    assembles, with finish_reason "tool_calls"; held text that holds no call goes out as content.
    Logprobs (when asked) ride on each chunk: those of the tokens delivered since the last one."""
    def chunk(delta: p.DeltaMessage, finish: Optional[str] = None) -> str:
        c = p.ChatCompletionChunk(id=rid, model=model, choices=[p.ChatChunkChoice(
            delta=delta, finish_reason=finish, logprobs=lps.chat(len(stream.token_ids)))])
        return _sse(c.model_dump_json())

    try:
        yield _sse(first.model_dump_json())
        async for piece in answer_pieces(stream):
            if piece.kind == "error":
                yield _sse(piece.error.body.model_dump_json())
                yield _sse("[DONE]")
                return
            if piece.kind == "reasoning":
                yield chunk(p.DeltaMessage(reasoning_content=piece.text))
            elif piece.kind == "content":
                yield chunk(p.DeltaMessage(content=piece.text))
            elif piece.kind == "calls":
                for i, call in enumerate(piece.calls):
                    yield chunk(p.DeltaMessage(tool_calls=[call.as_openai(index=i)]))
            else:
                yield chunk(p.DeltaMessage(), piece.finish)
        if include_usage:
            yield _sse(p.ChatCompletionChunk(id=rid, model=model, choices=[], usage=_usage(stream)).model_dump_json())
        yield _sse("[DONE]")
    finally:
        stream.cancel()


@dataclass
class Piece:
    """A piece of a chat answer as it streams (answer_pieces)."""

    kind: str  # "reasoning" | "content" | "calls" | "end" | "error"
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish: Optional[str] = None  # "stop", "length" or "tool_calls" (end)
    error: Optional[ApiError] = None  # (error)


async def answer_pieces(stream: RequestStream) -> AsyncIterator[Piece]:
    """A chat answer as it comes, in the pieces every dialect's events are made of (chat's tool
    stream here, Anthropic's and the Responses API's: answer_stream.py): reasoning, content, the
    tool calls once the answer is complete, then the end. With tools, text streams as content
    while it cannot be the start of a call (_free_text_end) and is held from there to the end;
    held text that holds no call goes out as content then. The request is cancelled however the
    iteration ends."""
    splitter = getattr(stream, "reasoning", None)
    # Harmony's content is its final channel: never the start of a call (those have their own)
    tools = bool(getattr(stream, "tool_funcs", None)) and not isinstance(splitter, HarmonyParser)
    answer, sent = "", 0  # the answer less its reasoning; how much of it went out as content
    try:
        async for d in stream:
            if d.finish_reason in ("error", "abort"):
                yield Piece("error", error=_failure(stream))
                return
            reasoning, text = splitter.feed(d.text, d.finish_reason is not None) if splitter else ("", d.text)
            if reasoning:
                yield Piece("reasoning", reasoning)
            answer += text
            safe = _free_text_end(answer, stream.fenced_calls) if tools else len(answer)
            if safe > sent:
                yield Piece("content", answer[sent:safe])
                sent = safe
        _, calls = _answer(stream, answer)
        if not calls and answer[sent:]:  # with calls, all before the first went out above
            yield Piece("content", answer[sent:])
        if calls:
            yield Piece("calls", calls=calls)
        yield Piece("end", finish="tool_calls" if calls else stream.finish_reason)
    finally:
        stream.cancel()


class Logprobs:
    """A request's log-probabilities in OpenAI's shapes, handed out in order: each call returns
    those of the tokens delivered since the last (all of them for a whole response), None when
    the request did not ask. Request.output_logprobs[i] is set with output_ids[i], so those of
    delivered tokens may be read while the engine thread goes on. A token's text is its id
    decoded alone (special tokens kept), as vLLM shows it."""

    def __init__(self, tokenizer, stream: RequestStream, echo: bool = False) -> None:
        self.tokenizer, self.req = tokenizer, stream.req
        self.done = 0  # tokens handed out so far
        self.offset = 0  # characters of their texts (completions' text_offset)
        # computed for best_of's ranking alone (the client did not ask): not shown
        self.asked = self.req.sampling.logprobs is not None and not getattr(stream, "hide_logprobs", False)
        # completions' echo with logprobs: the prompt's tokens come first (the first one's null)
        self.echo = echo and self.asked

    def _next(self, upto: int) -> Optional[list]:
        if not self.asked:
            return None
        ids, lps = self.req.output_ids[self.done:upto], self.req.output_logprobs[self.done:upto]
        self.done = max(self.done, upto)
        got = list(zip(ids, lps))
        if self.echo:  # prompt logprobs are complete before the first output token is delivered
            self.echo, k = False, self.req.sampling.logprobs
            got = [(t, None if lp is None else _top(lp, k)) for t, lp in zip(self.req.prompt_ids, self.req.prompt_logprobs)] + got
        return got

    def prompt(self, k: Optional[int]) -> p.PromptLogprobs:
        """vLLM's prompt_logprobs with the top k: [None, {token id: Logprob}, ...]; None unless asked."""
        if k is None:
            return None
        out: list = []
        for token, lp in zip(self.req.prompt_ids, self.req.prompt_logprobs):
            if lp is None:
                out.append(None)
                continue
            d = {str(t): p.PromptLogprob(logprob=v, rank=r, decoded_token=self._text(t))
                 for r, (t, v) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k]), 1)}
            rank = lp.top_ids.index(token) + 1 if token in lp.top_ids else None  # of the engine's top count
            d.setdefault(str(token), p.PromptLogprob(logprob=lp.logprob, rank=rank, decoded_token=self._text(token)))
            out.append(d)
        return out

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def completion(self, upto: int) -> Optional[p.CompletionLogprobs]:
        got = self._next(upto)
        if got is None:
            return None
        out = p.CompletionLogprobs()
        for token, lp in got:
            text = self._text(token)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if lp is None:  # the prompt's first token (echo): nothing precedes it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top: dict[str, float] = {}
            for t, v in [*zip(lp.top_ids, lp.top_logprobs), (token, lp.logprob)]:  # and the chosen one, as vLLM
                top.setdefault(self._text(t), v)  # tokens of one text (bytes alone: U+FFFD) keep the likeliest
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top)
        return out

    def chat(self, upto: int) -> Optional[p.ChatLogprobs]:
        got = self._next(upto)
        if got is None:
            return None
        entry = lambda t, v: dict(token=self._text(t), logprob=v, bytes=list(self._text(t).encode()))  # noqa: E731
        return p.ChatLogprobs(content=[
            p.ChatTokenLogprob(**entry(token, lp.logprob),
                               top_logprobs=[p.TopLogprob(**entry(t, v)) for t, v in zip(lp.top_ids, lp.top_logprobs)])
            for token, lp in got])


def _dumped(v):
    """Pydantic request parts as the plain JSON they came as (tools.py and templates read dicts)."""
    if isinstance(v, list):
        return [_dumped(x) for x in v]
    return v.model_dump(exclude_none=True) if hasattr(v, "model_dump") else v


def _free_text_end(text: str, fenced: bool = False) -> int:
    """How much of an answer so far is surely content, not (the start of) a tool call.
    `fenced`: a ``` fence may open a call (tools.py), so text from one is held to the end."""
    body = text.lstrip()
    openers = (TOOL_TAG, *FAMILY_OPENERS, FENCE) if fenced else (TOOL_TAG, *FAMILY_OPENERS)
    if not body or body[0] in "{[" or any(o.startswith(body) for o in openers):
        return 0  # undecided, or Llama 3 style JSON calls: hold it all
    cuts = [i for i in (text.find(o) for o in openers) if i >= 0]
    if cuts:
        return min(cuts)
    # hold back a tail that could begin an opener
    return len(text) - max(_opener_tail(text, o) for o in openers)


def _opener_tail(text: str, opener: str) -> int:
    """The length of the longest tail of `text` that begins `opener`."""
    return next((k for k in range(min(len(opener) - 1, len(text)), 0, -1) if opener.startswith(text[-k:])), 0)


def _split_reasoning(stream: RequestStream) -> tuple[Optional[str], str]:
    """(reasoning or None, the rest) of a finished chat answer (reasoning.py)."""
    splitter = getattr(stream, "reasoning", None)
    if splitter is None:
        return None, stream.text
    _, text = splitter.feed(stream.text, final=True)
    return splitter.reasoning_text, text


def _delta(stream: RequestStream, d: Delta) -> p.DeltaMessage:
    """A streamed piece of a chat answer without tools: content, or reasoning (reasoning.py)."""
    splitter = getattr(stream, "reasoning", None)
    if splitter is None:
        return p.DeltaMessage(content=d.text if d.text or d.finish_reason is None else None)
    reasoning, text = splitter.feed(d.text, final=d.finish_reason is not None)
    return p.DeltaMessage(content=text or None, reasoning_content=reasoning or None)


def _answer(stream: RequestStream, text: str) -> tuple[Optional[str], list]:
    """(content, tool calls) of a finished chat answer's `text` (its reasoning left out)."""
    splitter = getattr(stream, "reasoning", None)
    if isinstance(splitter, HarmonyParser):  # its calls were read with its channels
        return (text or None) if splitter.calls else text, list(splitter.calls)
    funcs = getattr(stream, "tool_funcs", None)
    if not funcs:
        return text, []
    content, calls = parse_tool_calls(text, funcs, getattr(stream, "fenced_calls", True))
    return (content or None) if calls else content, calls


async def _drain(stream: RequestStream) -> RequestStream:
    try:
        async for _ in stream:
            pass
    finally:
        stream.cancel()
    if stream.finish_reason in ("error", "abort"):
        raise _failure(stream)
    return stream


def _failure(stream: RequestStream) -> ApiError:
    return ApiError(500, stream.error or "the request was aborted", "server_error", code="engine_error")


def _top(lp: TokenLogprobs, k: int) -> TokenLogprobs:
    return TokenLogprobs(lp.logprob, lp.top_ids[:k], lp.top_logprobs[:k])


def _shown(stream: RequestStream) -> int:
    """Output tokens a completion shows: none for max_tokens 0 (echo alone)."""
    return 0 if getattr(stream, "hide_output", False) else len(stream.token_ids)


def cumulative_logprob(stream: RequestStream) -> float:
    """The sum of the log-probabilities of the tokens a completion shows (best_of's ranking)."""
    return sum(lp.logprob for lp in stream.req.output_logprobs[:_shown(stream)])


def _best(streams: list[RequestStream]) -> list[RequestStream]:
    """best_of: of each prompt's samples, the `keep` (its n) with the highest cumulative
    log-probability, best first (vLLM's order; ties keep the sample order); the prompts in order.
    Without best_of over n, every stream as it is."""
    by_prompt: dict[int, list[RequestStream]] = {}
    for s in streams:
        by_prompt.setdefault(getattr(s, "prompt_index", 0), []).append(s)
    out = []
    for group in by_prompt.values():
        keep = getattr(group[0], "keep", len(group))
        out += sorted(group, key=cumulative_logprob, reverse=True)[:keep] if keep < len(group) else group
    return out


def _usage(*streams: RequestStream) -> p.UsageInfo:
    """One request's usage; for n samples of a prompt the prompt once, the samples' outputs summed,
    and the most prompt tokens one sample read from the prefix cache (samples.py); for several
    prompts (completions) the sum of theirs."""
    by_prompt: dict[int, list[RequestStream]] = {}
    for s in streams:
        by_prompt.setdefault(getattr(s, "prompt_index", 0), []).append(s)
    prompt = cached = 0
    for group in by_prompt.values():
        n = len(group[0].req.prompt_ids)
        prompt += n
        cached += max(min(n, s.req.stats.cached_tokens) for s in group)
    return p.usage(prompt, sum(_shown(s) for s in streams), cached)


async def _drain_all(stream: Union[RequestStream, Samples]) -> list[RequestStream]:
    """Every sample's stream, run to its end (all cancelled if one fails)."""
    if not isinstance(stream, Samples):
        return [await _drain(stream)]
    try:
        return list(await asyncio.gather(*[_drain(s) for s in stream.streams]))
    finally:
        stream.cancel()


def _sse(data: str) -> str:
    return f"data: {data}\n\n"
