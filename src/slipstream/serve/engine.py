"""The scoring engine: an asyncio queue feeding an adaptive batcher over planned static shapes.

Flow: `score()` admits a request (or refuses it at once: 503 when the queue is full or the
predicted wait already exceeds the shedding budget, 413 when it is too long) → the batcher takes
the oldest request and keeps collecting while waiting is still affordable → expired requests are
answered 504 without compute → `partition` cuts the rest into planned shapes → each shape runs on
one compute thread (the event loop keeps admitting meanwhile) → results are split per request.

The batch window is adaptive (after BentoML): with the oldest request's age `w`, the predicted
latency `t(n+1)` of the batch with one more request (measured per shape at warm-up, then an
EWMA of real batches) and the mean gap `g` between arrivals, the batch closes when
`w + t(n+1) + g > latency_budget_s` — i.e. when waiting for one more request would be expected to
break the budget — when it is full, when the measured costs say a bigger batch does not cost
less per request (a compute-bound CPU: waiting would only add latency), or when the workers are
less than half busy (nothing would queue, so there is no throughput to gain). Under load the queue is
never empty when a worker frees up, so batches fill without any waiting at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from ..recipe import RecipeError
from .batching import ShapePlan, ewma, partition, plan_shapes
from .compiled import compile_for_serving
from .metrics import ServeMetrics
from .model import LoadedModel

IGNORE_INDEX = -100


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16
    """Most requests in one forward pass."""
    max_batch_tokens: int = 8192
    """Most (padded) tokens in one forward pass; caps the batch size of long rows."""
    n_lengths: int = 8
    """Planned row lengths (buckets), the longest being the model's max_len."""
    max_queue: int = 512
    """Requests waiting at most; more are refused with 503."""
    latency_budget_s: float = 0.5
    """Target latency (queue + compute) the batch window keeps to."""
    shed_wait_s: float | None = None
    """Refuse (503) a request whose predicted queue wait exceeds this; None = latency_budget_s."""
    default_timeout_s: float = 10.0
    """Deadline of a request that names none; past it the request gets 504 without compute."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype: bf16 runs under autocast."""
    warmup_reps: int = 3
    """Forward passes per shape at warm-up (the median of the steady ones is the shape's latency:
    all but the first, or but the first two when compiled on CUDA, whose second run records the
    CUDA graph)."""
    compile: bool = False
    """torch.compile the forward (inductor, weights frozen as constants; a CUDA graph per shape on
    CUDA). Compiling happens during warm-up, before the engine says ready."""
    batch_sizes: Literal["auto", "pow2", "all"] = "auto"
    """Planned batch sizes per length: powers of two, or every size up to the cap. auto: all for
    static shapes on a CPU (cost linear in rows: a padded row is wasted compute), else pow2 (CUDA:
    one graph per shape, cost flat in rows; eager CPU: shapes are only the cost model)."""
    static_shapes: Literal["auto", "on", "off"] = "auto"
    """on: every forward runs a planned (batch, length) shape, as compiled code and CUDA graphs
    need. off: a batch is padded only to its own longest row and real size (eager code gains
    nothing from padding); the planned shapes remain the cost model. auto: on for CUDA or when
    compiled, off for eager CPU."""
    workers: int = 1
    """Batches computed concurrently, each on its own thread (on CPUs: one per core group, with
    torch intra-op threads = cores / workers; on CUDA keep 1: compiled, the forwards replay on one
    thread anyway, and only the padding and copies run in parallel)."""


class ServeError(Exception):
    """A request that cannot be served; carries the HTTP status and a message naming the fix."""

    def __init__(
        self, status: int, message: str, retry_after_s: float | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param
        """The request field at fault, when one is (OpenAI errors name it)."""


@dataclass
class _Request:
    tokens: np.ndarray
    row_length: int
    cost_s: float
    """Predicted compute seconds of this request's row (its length's best measured cost per token)."""
    admitted: float
    deadline: float
    future: asyncio.Future
    want_token_logprobs: bool


@dataclass
class EngineStats:
    batches: int = 0
    requests: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    expired: int = 0
    failed_batches: int = 0
    shapes_run: dict[str, int] = field(default_factory=dict)


def _autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class ScoreEngine:
    """Scores token sequences (log-prob of each token given its prefix) in dynamic batches."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        expected_lengths: np.ndarray | list[int] | None = None,
        metrics: ServeMetrics | None = None,
    ):
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.metrics = metrics or ServeMetrics()
        self.device = next(loaded.model.parameters()).device
        static = self.config.static_shapes
        if self.config.compile and static == "off":
            raise RecipeError(
                "compile with static_shapes=off would compile new shapes while serving; "
                "use static_shapes=on or auto (--static-shapes auto)"
            )
        self.static_shapes = static == "on" or (
            static == "auto" and (self.device.type == "cuda" or self.config.compile)
        )
        every = self.config.batch_sizes == "all" or (
            self.config.batch_sizes == "auto" and self.static_shapes and self.device.type == "cpu"
        )
        lengths = expected_lengths if expected_lengths is not None else [loaded.max_len]
        self.plan: ShapePlan = plan_shapes(
            lengths,
            max_len=loaded.max_len,
            n_lengths=self.config.n_lengths,
            max_batch_size=self.config.max_batch_size,
            max_batch_tokens=self.config.max_batch_tokens,
            every_batch_size=every,
        )
        self._model = (
            compile_for_serving(loaded.model, self.device, len(self.plan.shapes))
            if self.config.compile
            else loaded.model
        )
        self.stats = EngineStats()
        self.ready = False
        self.draining = False
        self._pending: deque[_Request] = deque()  # admitted, not yet in a batch (oldest first)
        self._available: asyncio.Event | None = None
        self._started = False
        self._tasks: list[asyncio.Task] = []
        self._executor = ThreadPoolExecutor(
            max_workers=self.config.workers, thread_name_prefix="slipstream-score"
        )
        # Compiled on CUDA, every forward replays on this one thread, whatever the number of workers
        # (they still pad and copy batches in parallel): inductor keeps CUDA graphs per thread, and a
        # replay rewrites its graph's static output, so concurrent replays could overwrite a result
        # before it is copied out, and each worker would record its own graphs while serving.
        self._graph_thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-graphs")
            if replays_on_one_thread(self.config, self.device)
            else None
        )
        self._unsteady_runs = unsteady_warmup_runs(self.config, self.device)
        self._queued_s = 0.0  # predicted compute seconds of the queued requests
        self._inflight_s = 0.0  # ... and of the batches being computed
        self._inflight = 0
        self._gap_s = 1.0  # EWMA of the time between arrivals
        self._last_arrival: float | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def warmup(self, progress: Callable[[str], None] | None = None) -> dict[str, float]:
        """Run every planned shape `warmup_reps` times; record the median latency per shape.

        The first run of a shape (which includes any compile) is left out of the median, and on
        CUDA with compile the second too (it records the CUDA graph)."""
        skip = self._unsteady_runs
        reps = max(skip + 1, self.config.warmup_reps)
        shapes = self.plan.shapes
        for k, (b, L) in enumerate(shapes):
            rows = [np.full(L, 1, dtype=np.int64)] * b
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                self._forward(rows, b, L)
                times.append(time.perf_counter() - t0)
            self.plan.latency_s[(b, L)] = statistics.median(times[skip:])
            if progress is not None:
                progress(
                    f"warm-up {k + 1}/{len(shapes)}: {b}x{L} first {times[0]:.2f}s, "
                    f"then {self.plan.latency_s[(b, L)] * 1000:.1f} ms"
                )
        return {f"{b}x{L}": t for (b, L), t in self.plan.latency_s.items()}

    async def start(self, warmup: bool = True, progress: Callable[[str], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        if warmup:
            await loop.run_in_executor(self._executor, self.warmup, progress)
        self._available = asyncio.Event()
        self._started = True
        self._tasks = [
            asyncio.create_task(self._batcher(), name=f"slipstream-batcher-{i}")
            for i in range(self.config.workers)
        ]
        self.ready = True

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop admitting; let queued and in-flight requests finish. True if everything finished."""
        self.draining = True
        self.ready = False
        deadline = time.monotonic() + timeout_s
        while (self.queue_depth or self._inflight) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        done = not (self.queue_depth or self._inflight)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._graph_thread is not None:
            self._graph_thread.shutdown(wait=False, cancel_futures=True)
        return done

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    # -- admission -------------------------------------------------------------------------------

    def predicted_wait_s(self) -> float:
        return (self._queued_s + self._inflight_s) / self.config.workers

    @property
    def shed_budget_s(self) -> float:
        """Predicted queue wait past which a request is refused with 503."""
        return self.config.latency_budget_s if self.config.shed_wait_s is None else self.config.shed_wait_s

    def refusal(self) -> ServeError | None:
        """The 503 a score request would get now whatever it holds (draining, queue full, or
        predicted wait over the budget), or None. Lets the HTTP layer refuse before parsing."""
        if not self._started or self.draining:
            self.metrics.rejections.labels("draining" if self.draining else "not_ready").inc()
            return ServeError(
                503, "server is not accepting requests (starting or draining); retry shortly", 1.0
            )
        wait = self.predicted_wait_s()
        if len(self._pending) >= self.config.max_queue:
            self.metrics.rejections.labels("queue_full").inc()
            return ServeError(
                503, f"queue full ({self.config.max_queue} waiting); retry later", max(1.0, wait)
            )
        return self._refuse_wait(wait, self.shed_budget_s)

    def _refuse_wait(self, wait: float, limit: float) -> ServeError | None:
        if wait <= limit:
            return None
        self.metrics.rejections.labels("predicted_wait").inc()
        return ServeError(
            503, f"overloaded: predicted queue wait {wait:.3f}s exceeds the budget", max(1.0, wait)
        )

    async def score(
        self, tokens: list[int] | np.ndarray, timeout_s: float | None = None, token_logprobs: bool = False
    ) -> dict:
        if not self._started or self.draining:
            raise self.refusal()
        arr = np.asarray(tokens, dtype=np.int64)
        n = int(arr.shape[0]) if arr.ndim == 1 else -1
        if n < 2:
            raise ServeError(
                422, "a sequence to score needs at least 2 tokens (the first token is only context)"
            )
        if n > self.plan.max_len:
            self.metrics.rejections.labels("too_long").inc()
            raise ServeError(
                413, f"sequence of {n} tokens exceeds the model's max_len {self.plan.max_len}; split it"
            )
        if arr.min() < 0 or arr.max() >= self.loaded.vocab_size:
            raise ServeError(422, f"token ids must lie in [0, {self.loaded.vocab_size})")
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ServeError(422, "timeout_s must be a positive number of seconds")
        L = self.plan.length_for(n)
        # Draining, queue full, wait over the budget; then this request's own deadline.
        refused = self.refusal() or self._refuse_wait(self.predicted_wait_s(), timeout)
        if refused is not None:
            raise refused
        now = time.monotonic()
        if self._last_arrival is not None:
            self._gap_s = ewma(self._gap_s, now - self._last_arrival, alpha=0.1)
        self._last_arrival = now
        cost = L * self.plan.seconds_per_token(L)
        req = _Request(
            arr, L, cost, now, now + timeout, asyncio.get_running_loop().create_future(), token_logprobs
        )
        self._pending.append(req)
        self._available.set()
        self._queued_s += cost
        self.metrics.queue_depth.set(self.queue_depth)
        return await req.future

    # -- batching --------------------------------------------------------------------------------

    def _pop(self) -> _Request:
        req = self._pending.popleft()
        self._queued_s -= req.cost_s
        if not self._pending:
            self._available.clear()
        return req

    def _push_back(self, req: _Request) -> None:
        """Return a request to the head of the queue (another worker or the next batch takes it)."""
        self._pending.appendleft(req)
        self._queued_s += req.cost_s
        self._available.set()

    async def _wait_pending(self, timeout: float | None = None) -> bool:
        if not self._pending:
            try:
                await asyncio.wait_for(self._available.wait(), timeout)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                return False
        return bool(self._pending)

    def _fits_one_batch(self, batch: list[_Request], req: _Request) -> bool:
        """Whether `req` joins this batch: the measured-cost partition keeps them in one shape."""
        return len(partition([len(r.tokens) for r in batch] + [len(req.tokens)], self.plan)) == 1

    async def _collect(self) -> list[_Request]:
        """One batch = one planned shape; requests that would rather run apart stay queued for
        the next batch or another worker."""
        while not await self._wait_pending():
            pass
        batch = [self._pop()]
        first = batch[0]
        cfg = self.config
        while len(batch) < cfg.max_batch_size:
            while self._pending and len(batch) < cfg.max_batch_size:
                req = self._pop()
                if not self._fits_one_batch(batch, req):
                    self._push_back(req)
                    return batch
                batch.append(req)
            if len(batch) >= cfg.max_batch_size or self.draining:
                break
            L = max(r.row_length for r in batch)
            b = self.plan.batch_for(len(batch) + 1, L)
            if b is None or not self._batching_pays(len(batch), b, L) or not self._busy_enough(L):
                break
            now = time.monotonic()
            # Keep to the budget and to every batched request's own deadline.
            room = min(cfg.latency_budget_s - (now - first.admitted), min(r.deadline for r in batch) - now)
            slack = room - self.plan.predict(b, L)
            if slack <= self._gap_s:
                break  # the next arrival is not expected in time to be worth the wait
            if not await self._wait_pending(timeout=min(slack, 2 * self._gap_s)):
                break
        return batch

    def _batching_pays(self, n: int, b: int, L: int) -> bool:
        """Waiting for one more request is worth it only if a bigger batch costs less per request.

        Measured, not assumed: on a GPU a (b, L) forward costs about as much as (1, L); on a
        compute-bound CPU it costs b times as much (or more), and waiting only adds latency.
        """
        current = self.plan.batch_for(n, L) or n
        if (b, L) not in self.plan.latency_s or (current, L) not in self.plan.latency_s:
            return False  # unmeasured (no warm-up): do not wait on a guess
        return self.plan.predict(b, L) / (n + 1) < 0.9 * self.plan.predict(current, L) / n

    def _busy_enough(self, L: int) -> bool:
        """Waiting only pays when the workers are at least half busy; below that a request runs
        at once. Utilisation = (one request's measured cost) / (mean gap between arrivals x
        workers): at 4 req/s on a 5 ms forward nothing queues, so waiting for a batch-mate would
        only add latency (it added ~0.5 s to p99 at low rates before this check)."""
        return self.plan.predict(1, L) / (self._gap_s * self.config.workers) >= 0.5

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            self.metrics.queue_depth.set(self.queue_depth)
            now = time.monotonic()
            live = []
            for r in batch:
                if r.future.done():  # the client went away
                    continue
                if now > r.deadline:
                    self.stats.expired += 1
                    self.metrics.rejections.labels("deadline").inc()
                    r.future.set_exception(
                        ServeError(504, "deadline passed while queued; raise timeout_s or retry")
                    )
                    continue
                live.append(r)
            if not live:
                continue
            groups = partition([len(r.tokens) for r in live], self.plan)
            groups.sort(key=lambda g: min(live[i].deadline for i in g[0]))  # earliest deadline first
            self._inflight += len(live)
            # Priced once: the EWMA moves as batches finish, and the same amount must come off.
            priced = [self.plan.predict(b, L) for _, b, L in groups]
            self._inflight_s += sum(priced)
            for (idx, b, L), cost in zip(groups, priced):
                reqs = [live[i] for i in idx]
                start = time.monotonic()
                for r in reqs:
                    self.metrics.queue_seconds.observe(start - r.admitted)
                # Eager code gains nothing from padding: run the batch at its own size and length.
                rb, rL = (b, L) if self.static_shapes else (len(reqs), max(len(r.tokens) for r in reqs))
                try:
                    out = await loop.run_in_executor(
                        self._executor, self._timed_forward, [r.tokens for r in reqs], rb, rL
                    )
                except Exception as err:  # a failing batch fails only its own requests
                    self.stats.failed_batches += 1
                    for r in reqs:
                        if not r.future.done():
                            r.future.set_exception(
                                ServeError(500, f"batch failed: {type(err).__name__}: {err}")
                            )
                    continue
                finally:
                    self._inflight -= len(reqs)
                    self._inflight_s -= cost
                nll, seconds = out
                self._record(reqs, b, L, seconds * (b * L) / (rb * rL), rb * rL)
                for r, row in zip(reqs, nll):
                    if not r.future.done():
                        r.future.set_result(_score_result(row, r.want_token_logprobs))

    def _record(self, reqs: list[_Request], b: int, L: int, seconds: float, computed: int) -> None:
        """`seconds` is the planned shape's (measured, or scaled by tokens when the batch ran
        smaller); `computed` the tokens actually run."""
        real = sum(len(r.tokens) for r in reqs)
        self.plan.observe(b, L, seconds)
        self.stats.batches += 1
        self.stats.requests += len(reqs)
        self.stats.real_tokens += real
        self.stats.padded_tokens += computed - real
        key = f"{b}x{L}"
        self.stats.shapes_run[key] = self.stats.shapes_run.get(key, 0) + 1
        self.metrics.batch_size.observe(len(reqs))
        self.metrics.compute_seconds.observe(seconds)
        self.metrics.real_tokens.inc(real)
        self.metrics.padded_tokens.inc(computed - real)

    # -- compute (runs on the compute thread) -----------------------------------------------------

    def _timed_forward(self, rows: list[np.ndarray], b: int, L: int) -> tuple[list[np.ndarray], float]:
        t0 = time.perf_counter()
        out = self._forward(rows, b, L)
        return out, time.perf_counter() - t0

    def _forward(self, rows: list[np.ndarray], b: int, L: int) -> list[np.ndarray]:
        """Negative log-likelihood of tokens 1..n-1 of each row, padded into one (b, L) forward."""
        x = torch.full((b, L), self.loaded.pad_id, dtype=torch.long)
        labels = torch.full((b, L), IGNORE_INDEX, dtype=torch.long)
        for i, row in enumerate(rows):
            t = torch.from_numpy(np.ascontiguousarray(row))
            x[i, : len(row)] = t
            labels[i, : len(row) - 1] = t[1:]
        x, labels = x.to(self.device), labels.to(self.device)
        if self._graph_thread is None:
            nll = self._nll(x, labels)
        else:
            nll = self._graph_thread.submit(self._nll, x, labels).result()
        return [nll[i, : len(row) - 1] for i, row in enumerate(rows)]

    def _nll(self, x: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
        with torch.inference_mode(), _autocast(self.device, self.config.dtype):
            nll = self.loaded.token_nll(self._model, x, labels)
        return nll.float().cpu().numpy()  # on the host before this thread's next replay


def replays_on_one_thread(config: EngineConfig, device: torch.device) -> bool:
    """Compiled forwards on CUDA replay CUDA graphs: all of them run on one thread (see ScoreEngine)."""
    return config.compile and device.type == "cuda"


def unsteady_warmup_runs(config: EngineConfig, device: torch.device) -> int:
    """Warm-up runs per shape left out of its latency: the first (compile, allocator warm-up) and,
    where forwards replay CUDA graphs, the second, in which inductor records the shape's graph."""
    return 2 if replays_on_one_thread(config, device) else 1


def _score_result(nll: np.ndarray, token_logprobs: bool) -> dict:
    n = int(nll.shape[0])
    total = float(-nll.sum(dtype=np.float64))
    out = {"scored_tokens": n, "logprob_sum": total, "loss": -total / n}
    if token_logprobs:
        out["token_logprobs"] = (-nll).astype(float).tolist()
    return out
