"""Load generator: open-loop Poisson, closed-loop concurrency, and a sweep for the highest rate
whose p99 stays under an SLO.

Two protocols, told apart by the URL: slipstream's own `/v1/score` and `/v1/generate`, and the
OpenAI API (`.../completions`, `.../chat/completions`) that any OpenAI-compatible server speaks
(ours, `transformers serve`, vLLM, llama.cpp). For OpenAI streams (SSE) it measures time to the
first chunk carrying text, the gaps between text chunks (inter-token latency), and output tokens
(the final usage chunk's `completion_tokens` when the server sends one, else the text chunks).

Open loop: arrival times are drawn up front (exponential gaps, seeded); each request's latency is
measured from its *intended* send time, so a stalled server or a saturated client shows up as
latency instead of silently lowering the offered rate (no coordinated omission). Closed loop: C
workers, each sending its next request when the previous one answers.

Targets are loopback only (127.0.0.1 / localhost / ::1); every loop is bounded by a request count
and by time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse, urlunparse

import numpy as np

from ..recipe import RecipeError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise RecipeError(f"--url {url!r}: load tests target only this machine (127.0.0.1, localhost, ::1)")


def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Refuse to start when nothing listens at the URL: a run against a stopped server would only
    count connection errors for the whole duration."""
    parts = urlparse(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        raise RecipeError(
            f"nothing answers at {parts.hostname}:{port} ({err.strerror or err}); "
            "start `slipstream serve` there first, or pass --url"
        ) from None


@dataclass
class LoadResult:
    mode: str
    """'open' (Poisson arrivals) or 'closed' (fixed concurrency)."""
    url: str
    offered_rate_rps: float | None
    concurrency: int | None
    duration_s: float
    sent: int
    ok: int
    errors_by_status: dict[str, int]
    """Non-200 answers by status; 'timeout' and 'connect' for transport failures."""
    throughput_rps: float
    """200 answers per second of the run."""
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    max_s: float | None
    ttft_p50_s: float | None = None
    """Streams: time to the first token (OpenAI: first chunk with non-empty text), from the
    intended send time."""
    ttft_p99_s: float | None = None
    tokens_per_s: float | None = None
    """Output (generated) tokens per second of the run."""
    late_sends: int = 0
    """Open loop: sends that started > 10 ms after their intended time (client saturated)."""
    ttft_p90_s: float | None = None
    itl_p50_s: float | None = None
    """OpenAI streams: inter-token latency, the gaps between successive text chunks of one
    answer, pooled over answers."""
    itl_p90_s: float | None = None
    itl_p99_s: float | None = None
    output_tokens: int = 0
    """Tokens generated in 200 answers (OpenAI: usage.completion_tokens, else text chunks)."""
    retry_after: int = 0
    """Refusals (non-200 answers) that carried a Retry-After header."""

    def passes(self, slo_p99_s: float, max_error_fraction: float = 0.01) -> bool:
        if self.p99_s is None or self.sent == 0:
            return False
        errors = self.sent - self.ok
        return self.p99_s <= slo_p99_s and errors <= max_error_fraction * self.sent

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class _Record:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    tokens: int = 0
    sent: int = 0
    late: int = 0
    retry_after: int = 0


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


_JSON = {"content-type": "application/json"}


def is_openai(url: str) -> bool:
    """An OpenAI completions or chat-completions URL (`.../completions`)."""
    return urlparse(url).path.rstrip("/").endswith("/completions")


async def _read_openai(resp, origin: float, rec: _Record) -> str | None:
    """Reads one OpenAI answer, SSE or JSON; records TTFT, inter-token gaps and output tokens of a
    200. Returns an error label when a 200 stream carried an error event, else None."""
    if resp.content_type != "text/event-stream":
        data = await resp.read()
        if resp.status == 200:
            rec.tokens += int((json.loads(data).get("usage") or {}).get("completion_tokens") or 0)
        return None
    stamps: list[float] = []
    usage, error = None, None
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        now = time.perf_counter()  # before parsing: the chunk's arrival
        chunk = line[5:].strip()
        if not chunk or chunk == b"[DONE]":
            continue  # read on to the end so the connection is reused
        obj = json.loads(chunk)
        if obj.get("error"):
            error = "stream-error"
        if obj.get("usage"):
            usage = obj["usage"].get("completion_tokens")
        for choice in obj.get("choices") or ():
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                stamps.append(now)
                break
    if resp.status == 200 and error is None:
        if stamps:
            rec.ttfts.append(stamps[0] - origin)
            rec.itls.extend(b - a for a, b in zip(stamps, stamps[1:]))
        rec.tokens += int(usage) if usage is not None else len(stamps)
    return error


async def _send(client, url: str, body: bytes, origin: float, rec: _Record, stream: bool) -> None:
    """One request (a pre-encoded JSON body); latency (and time to first token when streaming)
    measured from `origin`."""
    import aiohttp

    rec.sent += 1
    status = None
    try:
        async with client.post(url, data=body, headers=_JSON) as resp:
            status = resp.status
            if status != 200 and "Retry-After" in resp.headers:
                rec.retry_after += 1
            if is_openai(url):
                error = await _read_openai(resp, origin, rec)
                if error is not None:
                    rec.statuses[error] += 1
                    return
            elif stream:
                n, first = 0, None
                async for line in resp.content:
                    if line.startswith(b"data:") and b'"token"' in line:
                        n += 1
                        if first is None:
                            first = time.perf_counter() - origin
                if status == 200 and first is not None:
                    rec.ttfts.append(first)
                    rec.tokens += n
            else:
                data = await resp.read()
                if status == 200 and "generate" in url:
                    rec.tokens += len(json.loads(data).get("tokens", []))
    except asyncio.TimeoutError:  # aiohttp's timeouts; not the builtin TimeoutError before Python 3.11
        rec.statuses["timeout"] += 1
        return
    except aiohttp.ClientError:
        # no answer at all, or an answer cut off after its status line
        rec.statuses["connect" if status is None else "incomplete"] += 1
        return
    except ValueError:  # a body or SSE event that is not the JSON the protocol promises
        rec.statuses["bad-response"] += 1
        return
    rec.statuses[str(status)] += 1
    if status == 200:
        rec.latencies.append(time.perf_counter() - origin)


def _result(mode, url, rate, conc, elapsed, rec: _Record) -> LoadResult:
    ok = rec.statuses.get("200", 0)
    return LoadResult(
        mode=mode,
        url=url,
        offered_rate_rps=rate,
        concurrency=conc,
        duration_s=elapsed,
        sent=rec.sent,
        ok=ok,
        errors_by_status={k: v for k, v in sorted(rec.statuses.items()) if k != "200"},
        throughput_rps=ok / elapsed if elapsed > 0 else 0.0,
        p50_s=_pct(rec.latencies, 50),
        p90_s=_pct(rec.latencies, 90),
        p99_s=_pct(rec.latencies, 99),
        max_s=max(rec.latencies) if rec.latencies else None,
        ttft_p50_s=_pct(rec.ttfts, 50),
        ttft_p99_s=_pct(rec.ttfts, 99),
        tokens_per_s=rec.tokens / elapsed if rec.tokens and elapsed > 0 else None,
        late_sends=rec.late,
        ttft_p90_s=_pct(rec.ttfts, 90),
        itl_p50_s=_pct(rec.itls, 50),
        itl_p90_s=_pct(rec.itls, 90),
        itl_p99_s=_pct(rec.itls, 99),
        output_tokens=rec.tokens,
        retry_after=rec.retry_after,
    )


def _client(max_connections: int, timeout_s: float):
    """aiohttp rather than httpx: the client shares the machine with the server under test, and
    aiohttp costs a fraction of httpx's CPU per request; at 500 req/s an httpx client saturated
    a core on its own (and its pool's waiter queue grew quadratically), starving the server."""
    import aiohttp

    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=max_connections, force_close=False),
    )


def _encode(payloads: Sequence[dict | bytes]) -> list[bytes]:
    """JSON bodies; a payload already given as bytes (pre-encoded JSON) is sent as it is."""
    return [p if isinstance(p, bytes) else json.dumps(p, separators=(",", ":")).encode() for p in payloads]


async def open_loop(
    url: str,
    payloads: Sequence[dict | bytes],
    rate_rps: float,
    duration_s: float,
    *,
    seed: int = 0,
    timeout_s: float = 30.0,
    max_connections: int = 256,
    stream: bool = False,
) -> LoadResult:
    """Poisson arrivals at `rate_rps` for `duration_s`; latency from the intended send time."""
    check_loopback(url)
    if not (rate_rps > 0 and duration_s > 0) or not payloads:
        raise RecipeError("--rate and --duration must be > 0 and there must be payloads")
    rng = np.random.default_rng(seed)
    n_max = int(rate_rps * duration_s * 3 + 100)  # bound on the schedule's length
    gaps = rng.exponential(1.0 / rate_rps, size=n_max)
    times = np.cumsum(gaps)
    times = times[times < duration_s]
    picks = rng.integers(0, len(payloads), size=len(times))
    bodies = _encode(payloads)
    rec = _Record()
    async with _client(max_connections, timeout_s) as client:
        start = time.perf_counter()
        tasks = []
        for t, k in zip(times, picks):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.01:
                rec.late += 1
            tasks.append(asyncio.create_task(_send(client, url, bodies[k], start + t, rec, stream)))
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s + 5)
        elapsed = time.perf_counter() - start
    return _result("open", url, rate_rps, None, elapsed, rec)


async def closed_loop(
    url: str,
    payloads: Sequence[dict],
    concurrency: int,
    duration_s: float,
    *,
    seed: int = 0,
    timeout_s: float = 30.0,
    stream: bool = False,
) -> LoadResult:
    """`concurrency` workers, each sending its next request when the previous one answers."""
    check_loopback(url)
    if concurrency < 1 or duration_s <= 0 or not payloads:
        raise RecipeError("--concurrency must be >= 1, --duration > 0, and there must be payloads")
    rng = np.random.default_rng(seed)
    bodies = _encode(payloads)
    rec = _Record()
    async with _client(concurrency, timeout_s) as client:
        start = time.perf_counter()
        end = start + duration_s

        async def worker():
            while time.perf_counter() < end:
                await _send(
                    client, url, bodies[int(rng.integers(len(bodies)))], time.perf_counter(), rec, stream
                )

        await asyncio.wait(
            [asyncio.create_task(worker()) for _ in range(concurrency)], timeout=duration_s + timeout_s + 5
        )
        elapsed = time.perf_counter() - start
    return _result("closed", url, None, concurrency, elapsed, rec)


@dataclass
class SweepResult:
    url: str
    slo_p99_s: float
    max_rate_rps: float | None
    """Highest offered rate that passed (p99 <= SLO and errors <= 1%); None if even the first failed."""
    p99_at_max_s: float | None
    steps: list[dict]

    def to_json(self) -> dict:
        return asdict(self)


async def sweep(
    targets: dict[str, str],
    payloads: Sequence[dict] | Mapping[str, Sequence[dict]],
    *,
    slo_p99_s: float,
    start_rps: float = 5.0,
    factor: float = 1.5,
    refine_steps: int = 3,
    step_duration_s: float = 10.0,
    max_steps: int = 20,
    max_rps: float = 5000.0,
    min_rps: float = 0.05,
    seed: int = 0,
    pause_s: float = 1.0,
    timeout_s: float = 30.0,
    progress=None,
    before_step: Callable[[str], None] | None = None,
) -> dict[str, SweepResult]:
    """Find each target's highest Poisson rate with p99 <= SLO, the targets measured side by side.

    Rates grow geometrically from `start_rps` until a step fails, then `refine_steps` bisections
    between the last pass and the first fail. Each round runs every unfinished target once at its
    own next rate, alternating the order (A B, B A, ...), so slow drift of a shared machine hits
    all targets alike. `before_step(name)` runs before each step (the serving benchmark pauses
    the idle servers there, so their background polling does not tax the one measured).
    OpenAI targets are measured as `open_loop` does (streaming when the payloads ask for it).
    `payloads` may be one list for every target or a list per target name (the same requests
    but, say, each server's own `model` field).
    """
    for url in targets.values():
        check_loopback(url)
    if isinstance(payloads, Mapping):
        bodies = {name: _encode(payloads[name]) for name in targets}  # once, not per step
    else:
        shared = _encode(payloads)
        bodies = {name: shared for name in targets}
    state = {
        name: {
            "lo": None,
            "hi": None,
            "next": start_rps,
            "steps": [],
            "done": False,
            "p99": None,
            "refining": False,
            "refined": 0,
        }
        for name in targets
    }
    names = list(targets)
    for round_no in range(max_steps):
        active = [n for n in names if not state[n]["done"]]
        if not active:
            break
        order = active if round_no % 2 == 0 else active[::-1]
        for name in order:
            st = state[name]
            rate = st["next"]
            if before_step is not None:
                before_step(name)
            res = await open_loop(
                targets[name], bodies[name], rate, step_duration_s, seed=seed + round_no, timeout_s=timeout_s
            )
            ok = res.passes(slo_p99_s)
            st["steps"].append({"rate_rps": rate, "passed": ok, **res.to_json()})
            if progress is not None:
                p99 = "-" if res.p99_s is None else f"{res.p99_s * 1000:.0f} ms"
                progress(
                    f"{name}: {rate:.2f} req/s -> p99 {p99}, ok {res.ok}/{res.sent} {'pass' if ok else 'FAIL'}"
                )
            if ok:
                st["lo"], st["p99"] = rate, res.p99_s
            else:
                st["hi"] = rate
            if st["hi"] is None:
                st["next"] = rate * factor
                st["done"] = st["next"] > max_rps
            elif st["lo"] is None:  # even the first rate failed: step down until one passes
                st["next"] = rate / factor
                st["done"] = st["next"] < min_rps
            else:
                st["refined"] += 1 if st["refining"] else 0  # the first fail-after-pass ends growth
                st["refining"] = True
                if st["refined"] >= refine_steps:
                    st["done"] = True
                else:
                    st["next"] = (st["lo"] + st["hi"]) / 2
            await asyncio.sleep(pause_s)  # let the server's queue empty between steps
    return {
        name: SweepResult(
            targets[name], slo_p99_s, state[name]["lo"], state[name]["p99"], state[name]["steps"]
        )
        for name in names
    }


def models_url(url: str) -> str:
    """`.../v1/completions` or `.../v1/chat/completions` -> `.../v1/models`."""
    u = urlparse(url)
    cut = u.path.rfind("/v1/")
    if cut < 0:
        raise RecipeError(f"--url {url!r}: expected an OpenAI path (.../v1/completions); pass --model-name")
    return urlunparse(u._replace(path=u.path[:cut] + "/v1/models", query=""))


def served_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at GET /v1/models."""
    check_loopback(url)
    murl = models_url(url)
    try:
        with urllib.request.urlopen(murl, timeout=timeout_s) as resp:
            data = json.loads(resp.read())
        return str(data["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise RecipeError(f"GET {murl}: no model id ({err}); pass --model-name") from None


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"
