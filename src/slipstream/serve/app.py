"""The HTTP app (FastAPI) over a ScoreEngine and, optionally, a Generator; and its uvicorn runner.

Endpoints: the OpenAI-compatible POST /v1/completions, POST /v1/chat/completions and GET
/v1/models (`openai.py`); POST /v1/score, POST /v1/generate (`stream: true` → server-sent events),
GET /healthz (process alive), GET /readyz (200 only after every shape is warmed, 503 while
draining), GET /metrics (Prometheus), and FastAPI's /docs + /openapi.json.

Failure modes map to statuses with a JSON body `{"error": "..."}` (OpenAI's
`{"error": {"message", "type", "param", "code"}}` on the OpenAI endpoints): 413 body or sequence
too large, 422 malformed input (400 on the OpenAI endpoints, as OpenAI answers), 503 +
Retry-After when overloaded / not ready / draining, 504 when the deadline passed in the queue,
401 without the bearer token (when one is set).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import signal
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import ScoreEngine, ServeError
from .openai import OPENAI_PATHS, Text, add_openai_routes, openai_error, openai_error_body

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/generate")
SWITCH_INTERVAL_S = 0.0005


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int] | None = Field(
        None, description="token ids (bytes 0-255, BOS=256, EOS=257); give this or text"
    )
    text: Text | None = Field(None, description="UTF-8 text, scored as BOS + its bytes; give this or tokens")
    token_logprobs: bool = Field(False, description="also return the log-prob of every scored token")
    timeout_s: float | None = Field(None, gt=0, le=600, description="deadline; past it, 504 without compute")

    @model_validator(mode="after")
    def _one_input(self) -> ScoreRequest:
        if (self.tokens is None) == (self.text is None):
            raise ValueError("give exactly one of 'tokens' or 'text'")
        return self


class ScoreResponse(BaseModel):
    scored_tokens: int = Field(description="tokens scored (all but the first)")
    logprob_sum: float = Field(description="sum of log p(token | prefix), nats")
    loss: float = Field(description="mean negative log-likelihood per scored token, nats")
    token_logprobs: list[float] | None = None
    latency_s: float = Field(description="server-side seconds from admission to answer")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: Text | None = Field(None, description="UTF-8 prompt, encoded as BOS + bytes; give this or tokens")
    tokens: list[int] | None = Field(None, description="prompt token ids; give this or prompt")
    max_new_tokens: int = Field(64, ge=1, le=4096)
    temperature: float = Field(0.0, ge=0, le=100, description="0 = greedy")
    top_k: int | None = Field(None, ge=1, le=100000)
    seed: int = Field(
        0, ge=0, lt=2**31, description="sampling seed; same seed + prompt = same tokens, whatever the batch"
    )
    stop_at_eos: bool = True
    stream: bool = Field(False, description="server-sent events, one per token")
    timeout_s: float | None = Field(None, gt=0, le=600)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.tokens is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'prompt' or 'tokens'")
        return self


class GenerateResponse(BaseModel):
    tokens: list[int]
    text: str
    finish_reason: str
    time_to_first_token_s: float
    latency_s: float


class ErrorResponse(BaseModel):
    error: str


_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (401, 413, 422, 503, 504)}


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413 before the app parses them."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _send_json(
                send, 413, f"request body over {self.max_bytes} bytes; send less per request"
            )
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes:
                return await _send_json(
                    send, 413, f"request body over {self.max_bytes} bytes; send less per request"
                )
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def bearer_matches(header: str | bytes | None, token: str) -> bool:
    """Whether an Authorization header carries `token`, compared in constant time (`==` stops at the
    first differing byte, which lets a patient client time the token out byte by byte)."""
    if isinstance(header, str):
        header = header.encode("latin-1", "replace")  # ASGI servers decode header bytes as latin-1
    return hmac.compare_digest(header or b"", f"Bearer {token}".encode())


class ShedEarly:
    """ASGI middleware: under overload, refuse POST /v1/score and the generation endpoints with
    503 before reading the body.

    At several times the sustainable rate most requests are refused, and parsing and validating
    each refused body (~2.5 KB of JSON) takes event-loop time from the ones admitted, time the
    engine's wait prediction cannot see. Requests with a wrong bearer token pass through (401)."""

    def __init__(self, app, engine: ScoreEngine, generator, metrics, token: str | None):
        self.app = app
        self.engine = engine
        self.generator = generator
        self.metrics = metrics
        self.token = token

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            err = None
            if path == "/v1/score":
                err = self.engine.refusal()
            elif path in GENERATION_PATHS and self.generator is not None:
                err = self.generator.refusal()
            authorized = self.token is None or bearer_matches(
                dict(scope.get("headers") or []).get(b"authorization"), self.token
            )
            if err is not None and authorized:
                self.metrics.requests.labels(path.rsplit("/", 1)[-1], "503").inc()
                retry = str(max(1, math.ceil(err.retry_after_s or 1)))
                return await _send_json(
                    send, 503, err.message, [(b"retry-after", retry.encode())], openai=path in OPENAI_PATHS
                )
        return await self.app(scope, receive, send)


async def _send_json(
    send, status: int, message: str, headers: list | None = None, openai: bool = False
) -> None:
    body = json.dumps(openai_error_body(status, message) if openai else {"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def create_app(
    engine: ScoreEngine,
    generator=None,
    *,
    token: str | None = None,
    max_body_bytes: int = 1 << 20,
    drain_timeout_s: float = 30.0,
    warmup: bool = True,
    progress=None,
) -> FastAPI:
    """The app; the lifespan warms every shape (then /readyz turns 200) and drains on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start(warmup=warmup, progress=progress)
        if generator is not None:
            await generator.start(warmup=warmup)
        app.state.started = time.monotonic()
        yield
        app.state.draining = True
        await engine.drain(drain_timeout_s)
        if generator is not None:
            await generator.drain(drain_timeout_s)

    app = FastAPI(
        title="slipstream serve",
        description="Dynamic batching into planned static shapes; see docs/serve.md.",
        lifespan=lifespan,
        responses=_ERRORS,
    )
    app.state.draining = False
    app.state.engine = engine
    app.state.generator = generator
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    metrics = engine.metrics
    app.add_middleware(
        ShedEarly, engine=engine, generator=generator, metrics=metrics, token=token
    )  # outermost: runs first
    codec = engine.loaded.codec

    async def check_token(request: Request) -> None:
        if token is not None and not bearer_matches(request.headers.get("authorization"), token):
            raise ServeError(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'")

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, err: ServeError):
        headers = {}
        if err.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        endpoint = request.url.path.rsplit("/", 1)[-1]
        metrics.requests.labels(endpoint, str(err.status)).inc()
        if request.url.path in OPENAI_PATHS:
            return openai_error(err.status, err.message, err.param, headers)
        return JSONResponse({"error": err.message}, status_code=err.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        # The default handler echoes the input back, and an input of inf or nan cannot be encoded
        # as JSON (a 500 found by fuzzing); name each problem's location and message instead.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in err.errors()
        )
        endpoint = request.url.path.rsplit("/", 1)[-1]
        if request.url.path in OPENAI_PATHS:  # OpenAI answers a malformed body with 400
            metrics.requests.labels(endpoint, "400").inc()
            first = err.errors()[0].get("loc", ()) if err.errors() else ()
            param = ".".join(str(p) for p in first if p != "body") or None
            return openai_error(400, f"invalid request: {problems}"[:2000], param)
        metrics.requests.labels(endpoint, "422").inc()
        return JSONResponse({"error": f"invalid request: {problems}"[:2000]}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, err: StarletteHTTPException):
        # Unknown paths (404) and methods (405) answer in the same error shape as everything else,
        # naming what to do; not counted per path (any client-chosen path would be a new label).
        headers = dict(err.headers or {})
        if err.status_code == 404:
            message = f"no endpoint {request.url.path}; the endpoints are listed at /docs"
        elif err.status_code == 405:
            allowed = headers.get("allow") or headers.get("Allow") or "another method"
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
        else:
            message = str(err.detail)
        if request.url.path in OPENAI_PATHS:
            return openai_error(err.status_code, message, None, headers)
        return JSONResponse({"error": message}, status_code=err.status_code, headers=headers)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"model": ErrorResponse}})
    async def readyz():
        ready = engine.ready and not app.state.draining and (generator is None or generator.ready)
        if not ready:
            return JSONResponse(
                {"error": "warming up or draining"}, status_code=503, headers={"Retry-After": "1"}
            )
        return {"status": "ready", "shapes": len(engine.plan.shapes)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.queue_depth.set(engine.queue_depth)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post(
        "/v1/score",
        response_model=ScoreResponse,
        response_model_exclude_none=True,
        dependencies=[Depends(check_token)],
    )
    async def score(body: ScoreRequest) -> dict:
        t0 = time.monotonic()
        tokens = body.tokens if body.tokens is not None else codec.encode(body.text)
        out = await engine.score(tokens, timeout_s=body.timeout_s, token_logprobs=body.token_logprobs)
        metrics.requests.labels("score", "200").inc()
        return {**out, "latency_s": time.monotonic() - t0}

    @app.post("/v1/generate", response_model=GenerateResponse, dependencies=[Depends(check_token)])
    async def generate(body: GenerateRequest):
        if generator is None:
            raise ServeError(503, "generation is off on this server; start it with --generate-slots N")
        t0 = time.monotonic()
        prompt = body.tokens if body.tokens is not None else codec.encode(body.prompt)
        params = dict(
            max_new_tokens=body.max_new_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            seed=body.seed,
            stop_at_eos=body.stop_at_eos,
            timeout_s=body.timeout_s,
        )
        stream = await generator.submit(
            prompt, **params
        )  # admission errors raise here, before any byte is sent
        if body.stream:

            async def events():
                async for tok in stream:
                    yield f"data: {json.dumps({'token': tok, 'text': codec.decode([tok])})}\n\n"
                metrics.requests.labels("generate", "200").inc()
                yield f"data: {json.dumps({'done': True, 'finish_reason': stream.finish_reason})}\n\n"

            return StreamingResponse(
                events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        tokens, first = [], None
        async for tok in stream:
            first = first if first is not None else time.monotonic() - t0
            tokens.append(tok)
        metrics.requests.labels("generate", "200").inc()
        return {
            "tokens": tokens,
            "text": codec.decode(tokens),
            "finish_reason": stream.finish_reason,
            "time_to_first_token_s": first if first is not None else 0.0,
            "latency_s": time.monotonic() - t0,
        }

    add_openai_routes(app, engine.loaded, generator, metrics, check_token)
    return app


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, drain_timeout_s: float = 30.0) -> int:
    """Serve until SIGTERM/SIGINT; on SIGTERM stop admitting, finish in-flight work, return 0."""
    import sys

    import uvicorn

    # The compute thread runs Python-heavy eager forwards (a Hugging Face decoder layer is
    # dozens of small ops) while the event loop streams tokens; at CPython's default 5 ms GIL
    # switch interval each hand-over could stall a decode step by up to 5 ms. Measured with
    # `loadtest --endpoint completions --stream --rate 4` (HF Llama, 32 slots, 2-core host D):
    # ITL p50 11.4 -> 7.1 ms, end-to-end p50 842 -> 495 ms at 0.5 ms (0.1 ms was worse: 602 ms).
    # This is the server's own process, so the setting is scoped to it.
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.draining = True  # /readyz answers 503 from now on
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                # A drained SIGTERM is a clean exit: do not re-raise it after shutdown (exit 0, not 143).
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=int(math.ceil(drain_timeout_s)),
        lifespan="on",
        access_log=False,
    )
    server = DrainingServer(config)
    asyncio.run(server.serve())
    return 0 if server.started else 1
