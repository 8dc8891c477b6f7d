"""The OpenAI-compatible API over the Generator: /v1/completions, /v1/chat/completions, /v1/models.

Request bodies follow OpenAI's schemas. What is supported is honoured; a field this server does
not support, or a value of a known field it cannot honour (tools, logit_bias, penalties other than
0, echo, best_of > 1, ...), is refused with a 400 that names it — never ignored. Errors use
OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

A request with `n > 1` runs n sequences in the generator (seeds seed, seed+1, ...). Streaming
(`stream: true`) sends server-sent events, one chunk per released text delta, then
`data: [DONE]`; `stream_options.include_usage` adds the usage chunk before it. The first token of
every choice is awaited before the response starts, so a request refused or expired while queued
gets its real status (503 + Retry-After, 504) rather than a broken stream.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..recipe import RecipeError
from .engine import ServeError
from .generate import Generator, TokenLogprob, TokenStream
from .model import LoadedModel
from .text import Detokenizer, StopMatcher

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
MAX_N = 8
MAX_STOPS = 4


def _utf8(text: str) -> str:
    # JSON's "\ud800" escape decodes to a lone surrogate: a str no tokenizer can encode (a 500 before)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"holds a lone surrogate at character {err.start}, which is not text; send valid UTF-8"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
"""A request string that will be tokenized: refused (422, or 400 on the OpenAI endpoints) unless
it has a UTF-8 form."""


class _Body(BaseModel):
    # Unknown fields are collected (not dropped) so that they can be refused by name.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, description="an end-user id; recorded nowhere, changes nothing")
    timeout_s: float | None = Field(
        None, gt=0, le=600, description="slipstream extension: deadline (504 if still queued)"
    )
    ignore_eos: bool = Field(False, description="slipstream/vLLM extension: generate max_tokens tokens")


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _text_prompt(cls, prompt):
        for p in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(p, str):
                _utf8(p)
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_content(cls, content):
        return _utf8(content) if isinstance(content, str) else content


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


def openai_error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object for a status."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        503: "overloaded_error",
        504: "timeout_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def openai_error(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(openai_error_body(status, message, param), status_code=status, headers=headers)


def _refuse(param: str, why: str) -> ServeError:
    return ServeError(400, f"'{param}' {why}", param=param)


def _check_supported(body: _Body) -> None:
    """Refuse, by name, every field this server would otherwise have to ignore."""
    if body.model_extra:
        names = ", ".join(sorted(body.model_extra))
        raise _refuse(names, "is not supported by this server; remove it")
    if body.presence_penalty or body.frequency_penalty:
        raise _refuse("presence_penalty/frequency_penalty", "other than 0 is not supported")
    if body.logit_bias:
        raise _refuse("logit_bias", "is not supported")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > MAX_STOPS:
        raise _refuse("stop", f"takes at most {MAX_STOPS} strings")
    if body.stream_options is not None:
        if not body.stream:
            raise _refuse("stream_options", "needs stream: true")
        if set(body.stream_options) - {"include_usage"}:
            raise _refuse("stream_options", "supports only include_usage")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise _refuse("echo", "is not supported")
        if body.best_of not in (None, 1):
            raise _refuse("best_of", "other than 1 is not supported")
        if body.suffix is not None:
            raise _refuse("suffix", "is not supported")
    if isinstance(body, ChatRequest):
        if body.tools or body.tool_choice not in (None, "none"):
            raise _refuse("tools", "(function calling) is not supported")
        if body.response_format not in (None, {"type": "text"}):
            raise _refuse("response_format", "other than {'type': 'text'} is not supported")
        if body.top_logprobs is not None and not body.logprobs:
            raise _refuse("top_logprobs", "needs logprobs: true")


def _message_text(msg: ChatMessage) -> str:
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for part in msg.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _refuse("messages.content", "supports only text parts")
        parts.append(part["text"])
    return "".join(parts)


def _prompts(body: _Body, loaded: LoadedModel) -> list[list[int]]:
    if isinstance(body, ChatRequest):
        messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
        try:
            return [loaded.codec.chat(messages)]
        except RecipeError as err:
            raise _refuse("messages", str(err)) from err
        except Exception as err:  # a template that raises on these messages (e.g. role order)
            raise _refuse("messages", f"the chat template refused them: {err}") from err
    p = body.prompt
    if isinstance(p, str):
        return [loaded.codec.encode(p)]
    if not p:
        raise _refuse("prompt", "is empty")
    if all(isinstance(x, str) for x in p):
        return [loaded.codec.encode(x) for x in p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return [list(x) for x in p]


class _Choice:
    """One sequence's text as it is released: detokenized, cut at stop strings."""

    def __init__(self, index: int, stream: TokenStream, loaded: LoadedModel, stops: list[str]):
        self.index = index
        self.stream = stream
        self.codec = loaded.codec
        self.detok = Detokenizer(loaded.codec)
        self.stops = StopMatcher(stops)
        self.tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list[tuple[int, TokenLogprob]] = []

    async def deltas(self, first: int | None) -> AsyncIterator[str]:
        """Text deltas; `first` is the token already awaited before the response started."""
        pending = [first] if first is not None else []
        it = aiter(self.stream)
        while True:
            if pending:
                token = pending.pop()
            else:
                try:
                    token = await anext(it)
                except StopAsyncIteration:
                    break
            if self.stream.logprobs and len(self.stream.logprobs) > self.tokens:
                self.logprobs.append((token, self.stream.logprobs[self.tokens]))
            self.tokens += 1
            text = self.stops.feed(self.detok.add(token))
            if text:
                yield text
            if self.stops.stopped:
                self.stream.cancel()
                self.finish_reason = "stop"
                return
        tail = self.codec.decode(self.detok.ids)[len(self.detok.text) :]  # an unfinished character
        text = self.stops.feed(tail) + self.stops.flush()
        if text:
            yield text
        reason = self.stream.finish_reason
        self.finish_reason = "stop" if reason in ("eos", "stop") else "length"


async def _start(gen: Generator, prompts: list[list[int]], body: _Body, max_tokens: int, logprobs):
    """Submit every choice and await each one's first token (queued errors surface here)."""
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    streams = []
    try:
        for p in prompts:
            for i in range(body.n):
                streams.append(
                    await gen.submit(
                        p,
                        max_new_tokens=max_tokens,
                        temperature=body.temperature,
                        top_p=body.top_p,
                        seed=(seed + i) % 2**31,
                        stop_at_eos=not body.ignore_eos,
                        timeout_s=body.timeout_s,
                        logprobs=logprobs,
                    )
                )
        firsts = []
        for s in streams:
            firsts.append(await anext(aiter(s), None))
        return streams, firsts
    except BaseException:
        for s in streams:
            s.cancel()
        raise


def _max_tokens(body: _Body, prompts: list[list[int]], loaded: LoadedModel) -> int:
    room = loaded.max_len - max(len(p) for p in prompts)
    if room < 1:
        raise _refuse("prompt", f"is {loaded.max_len - room} tokens; the model's context is {loaded.max_len}")
    asked = body.max_completion_tokens if isinstance(body, ChatRequest) else None
    asked = asked or body.max_tokens
    if asked is None:
        return room
    if asked > room:
        raise _refuse(
            "max_tokens",
            f"({asked}) + the prompt ({loaded.max_len - room} tokens) exceeds the model's context "
            f"of {loaded.max_len} tokens",
        )
    return asked


def _top_dict(codec, top) -> dict[str, float]:
    """OpenAI's {token text: logprob}; two tokens with the same text keep both (the id tells them apart)."""
    out: dict[str, float] = {}
    for i, v in top:
        text = codec.token_text(i)
        out[text if text not in out else f"{text}<{i}>"] = v
    return out


def _completion_logprobs(choice: _Choice) -> dict:
    decode = choice.codec.token_text
    tokens = [decode(t) for t, _ in choice.logprobs]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for _, lp in choice.logprobs],
        "top_logprobs": [_top_dict(choice.codec, lp.top) for _, lp in choice.logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(choice: _Choice) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text = choice.codec.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
            for t, lp in choice.logprobs
        ]
    }


def add_openai_routes(app: FastAPI, loaded: LoadedModel, generator: Generator | None, metrics, auth) -> None:
    """Register the OpenAI endpoints on `app`; `auth` is the app's bearer-token dependency."""
    from fastapi import Depends

    created = int(time.time())

    def check_model(body: _Body) -> None:
        if body.model != loaded.name:
            raise ServeError(
                404,
                f"model '{body.model}' is not served here; this server serves '{loaded.name}'",
                param="model",
            )

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": loaded.name, "object": "model", "created": created, "owned_by": "slipstream"}],
        }

    async def run(body: _Body, chat: bool):
        endpoint = "chat_completions" if chat else "completions"
        if generator is None:
            raise ServeError(503, "generation is off on this server; start it with --generate-slots N")
        check_model(body)
        _check_supported(body)
        prompts = _prompts(body, loaded)
        max_tokens = _max_tokens(body, prompts, loaded)
        if chat:
            lp = (body.top_logprobs or 0) if body.logprobs else None
        else:
            lp = body.logprobs
        try:
            streams, firsts = await _start(generator, prompts, body, max_tokens, lp)
        except ServeError as err:
            if err.status in (413, 422):  # the engine's input errors are OpenAI's 400
                raise ServeError(400, err.message) from err
            raise
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        choices = [_Choice(i, s, loaded, stops) for i, s in enumerate(streams)]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "created": int(time.time()), "model": loaded.name}
        prompt_tokens = sum(len(p) for p in prompts) * body.n

        def usage() -> dict:
            done = sum(c.tokens for c in choices)
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": done,
                "total_tokens": prompt_tokens + done,
            }

        if not body.stream:
            texts = await asyncio.gather(*[_collect(c, f) for c, f in zip(choices, firsts)])
            out = []
            for c, text in zip(choices, texts):
                if chat:
                    item = {"index": c.index, "message": {"role": "assistant", "content": text}}
                    item["logprobs"] = _chat_logprobs(c) if lp is not None else None
                else:
                    item = {"index": c.index, "text": text}
                    item["logprobs"] = _completion_logprobs(c) if lp is not None else None
                item["finish_reason"] = c.finish_reason
                out.append(item)
            metrics.requests.labels(endpoint, "200").inc()
            obj = "chat.completion" if chat else "text_completion"
            return JSONResponse({**head, "object": obj, "choices": out, "usage": usage()})

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, delta: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                d: dict = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({} if delta is None else {"content": delta})
                )
                item = {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                item = {"index": index, "text": delta or "", "logprobs": None, "finish_reason": finish}
            payload = {**head, "object": obj, "choices": [item]}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(c: _Choice, first):
                try:
                    async for delta in c.deltas(first):
                        await queue.put((c.index, delta, None))
                    await queue.put((c.index, None, c.finish_reason))
                except ServeError as err:
                    await queue.put((c.index, None, err))

            tasks = [asyncio.create_task(pump(c, f)) for c, f in zip(choices, firsts)]
            try:
                if chat:
                    for c in choices:
                        yield chunk(c.index, None, None, role=True)
                open_choices = len(choices)
                while open_choices:
                    index, delta, end = await queue.get()
                    if isinstance(end, ServeError):
                        err = {
                            "error": {
                                "message": end.message,
                                "type": "server_error",
                                "param": None,
                                "code": end.status,
                            }
                        }
                        yield f"data: {json.dumps(err)}\n\n"
                        open_choices -= 1
                    elif end is not None:
                        yield chunk(index, None if chat else "", end)
                        open_choices -= 1
                    else:
                        yield chunk(index, delta, None)
                if include_usage:
                    yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage()})}\n\n"
                yield "data: [DONE]\n\n"
                metrics.requests.labels(endpoint, "200").inc()
            finally:  # the client left (or we are done): free the slots
                for c in choices:
                    c.stream.cancel()
                for t in tasks:
                    t.cancel()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest):
        return await run(body, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: ChatRequest):
        return await run(body, chat=True)


async def _collect(choice: _Choice, first) -> str:
    return "".join([d async for d in choice.deltas(first)])
