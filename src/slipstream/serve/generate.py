"""Generation: prefill + decode over a preallocated slot cache, with continuous batching.

One decode path for every model: the model's *own* forward runs with a `kv.SlotCache` (one row
per running sequence, `[slots, kv_heads, max_len, head_dim]` per layer) and a 4-D mask — the
built-in GPT and any Hugging Face causal LM alike (`LoadedModel.cached_logits`). `decoder.Decoder`
runs the model:

- `prefill(slots, prompts)`: the prompts admitted together run as one right-padded forward (length
  rounded up to a multiple of 16 on CPU, 64 on CUDA, so prompts share a few shapes), capped at
  `max_prefill_tokens` per forward; each row's keys land in its slot, and only each row's last
  position goes through the LM head;
- `decode_one_token(tokens, positions)`: every slot advances one token in one [slots, 1] forward
  whose attention reads the cache up to a bucketed key length (multiples of 128) with a mask per
  slot; inactive slots ride along (a static shape), their results ignored. With `compile` this
  step is `torch.compile`d, one graph per key-length bucket, all compiled at warm-up.

Continuous (iteration-level) batching: between two decode steps, finished sequences leave and
waiting ones are prefilled into the free slots. Static batching (for comparison): a batch is
admitted only when every slot is free, and runs until its longest sequence ends.

Sampling (`sampling.sample`: greedy, temperature, top-k, top-p) runs on the device for the whole batch with Gumbel
noise from a counter-based hash of (seed, step, token id), so a request's tokens depend only on its
own seed and prompt — not on which other requests shared its batch — and no per-request host sync
is needed. One host copy per decode step (the batch's new tokens) feeds streaming and stop checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from .batching import ewma
from .decoder import Decoder, round_up
from .engine import ServeError
from .metrics import ServeMetrics
from .model import LoadedModel
from .sampling import sample


@dataclass(frozen=True)
class GeneratorConfig:
    slots: int = 8
    """Sequences decoded together (KV-cache slots)."""
    policy: Literal["continuous", "static"] = "continuous"
    """continuous: join/leave at every decode step; static: admit a batch only when all slots are free."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype (bf16 = autocast; the cache is kept in this dtype)."""
    compile: bool = False
    """torch.compile the decode step (one graph per key-length bucket)."""
    max_queue: int = 256
    """Waiting requests at most; more get 503."""
    default_timeout_s: float = 60.0
    """A request still waiting for a slot past its deadline gets 504."""
    shed_wait_s: float | None = None
    """Refuse (503) a request whose predicted wait for a slot exceeds this; None = its own
    deadline only (a request predicted to miss its deadline is refused at once, not left to 504)."""
    max_prefill_tokens: int = 4096
    """Padded prompt tokens per prefill forward at most (prompts admitted together share one)."""
    latency_budget_s: float | None = None
    """Refuse (503) a request whose predicted end-to-end latency (wait for a slot + its own
    max_new_tokens decode steps) exceeds this; None = no such limit."""


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float
    """log p(token) under the model's distribution (before temperature, top-k, top-p)."""
    top: tuple[tuple[int, float], ...]
    """The most likely tokens at this step and their log-probabilities."""


class TokenStream:
    """Async iterator over one request's generated tokens; `finish_reason` is set at the end.

    When log-probabilities were asked for, `logprobs[i]` describes the i-th token yielded."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.finish_reason: str | None = None
        self.error: ServeError | None = None
        self.cancelled = False
        self.logprobs: list[TokenLogprob] = []

    def put(self, token: int, logprob: TokenLogprob | None = None) -> None:
        if logprob is not None:
            self.logprobs.append(logprob)
        self._queue.put_nowait(token)

    def close(self, reason: str, error: ServeError | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self._queue.put_nowait(None)

    def cancel(self) -> None:
        """Stop generating (a stop string matched, or the client left): the slot frees at the next step."""
        self.cancelled = True

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        try:
            tok = await self._queue.get()
        except asyncio.CancelledError:
            self.cancelled = True  # the client went away: the slot is freed at the next step
            raise
        if tok is None:
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        return tok


@dataclass
class _Seq:
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    eos: frozenset[int]
    """Tokens that end the sequence (empty: run to max_new_tokens)."""
    logprobs: int | None
    """Top log-probabilities to return per token (0: only the chosen token's); None: none."""
    deadline: float
    stream: TokenStream
    admitted: float
    generated: int = 0
    position: int = 0
    last_token: int = 0
    first_token_s: float | None = None


@dataclass
class GeneratorStats:
    steps: int = 0
    tokens: int = 0
    prefills: int = 0
    prefill_batches: int = 0
    ttft_s: list[float] = field(default_factory=list)
    finished: int = 0


MAX_TOP_LOGPROBS = 20


class Generator:
    """Continuous (or static) batching over a Decoder, fed by an asyncio queue."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: GeneratorConfig | None = None,
        metrics: ServeMetrics | None = None,
        lock: threading.Lock | None = None,
    ):
        self.loaded = loaded
        self.config = config or GeneratorConfig()
        self.metrics = metrics or ServeMetrics()
        weights = next(loaded.model.parameters()).dtype
        bf16 = self.config.dtype == "bf16" or weights == torch.bfloat16
        self.decoder = Decoder(
            loaded, self.config.slots, torch.bfloat16 if bf16 else torch.float32, self.config.compile
        )
        self.device = self.decoder.device
        self.stats = GeneratorStats()
        self.ready = False
        self.draining = False
        self._lock = lock or threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-generate")
        self._pending: deque[_Seq] | None = None  # admitted, waiting for a slot (oldest first)
        self._slots: list[_Seq | None] = [None] * self.config.slots
        self._task: asyncio.Task | None = None
        self._step_s: float | None = None  # EWMA seconds of one decode step (measured)
        # EWMA seconds between two decode steps' ends while sequences run: the step plus the
        # prefills and event-loop work between steps, i.e. what a running sequence waits per token
        self._interval_s: float | None = None
        self._last_step_end: float | None = None
        self._prefill_s: float | None = None  # EWMA seconds of one prompt's prefill (measured)

    def _autocast(self):
        if self.config.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- lifecycle -------------------------------------------------------------------------------

    def warmup(self) -> None:
        """A prefill, and the decode step once per key-length bucket when compiled (each bucket is
        its own graph: all are compiled here, before the server says ready), else once."""
        dec = self.decoder
        with self._lock, self._autocast():
            dec.prefill([0], [[self.loaded.pad_id] * min(16, dec.max_len)])
            S = self.config.slots
            for key_len in dec.key_buckets(dec.max_len if self.config.compile else 1):
                pos = torch.full((S,), key_len - 1, dtype=torch.long, device=self.device)
                dec.decode_one_token(torch.full((S,), self.loaded.pad_id, device=self.device), pos)

    async def start(self, warmup: bool = True) -> None:
        if warmup:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.warmup)
        self._pending = deque()
        self._task = asyncio.create_task(self._loop(), name="slipstream-generator")
        self.ready = True

    async def drain(self, timeout_s: float = 30.0) -> bool:
        self.draining, self.ready = True, False
        deadline = time.monotonic() + timeout_s
        while (self._active() or self._pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        done = not (self._active() or self._pending)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=False, cancel_futures=True)
        return done

    def _active(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def queue_depth(self) -> int:
        return len(self._pending or ())

    def predicted_wait_s(self) -> float:
        """Seconds until a request submitted now would get a slot and its first token.

        Each running sequence frees its slot after its remaining tokens (max_new_tokens is an
        upper bound: EOS may end it sooner, so this errs towards refusing); each queued request
        then takes the earliest free slot for its own max_new_tokens. Steps are priced at the
        measured decode-step time, prefills at the measured prefill time (0 before any is
        measured: nothing is refused on a guess)."""
        if self._step_s is None:
            return 0.0
        per_token = self._per_token_s()
        free_at = [
            0 if s is None else max(0, s.max_new_tokens - s.generated) for s in self._slots
        ]  # decode steps until each slot frees
        heapq.heapify(free_at)
        prefill = self._prefill_s or 0.0
        waiting = self._pending or ()
        for seq in waiting:  # policy-agnostic: static batching only waits longer
            heapq.heappush(free_at, heapq.heappop(free_at) + seq.max_new_tokens)
        return free_at[0] * per_token + (len(waiting) + 1) * prefill

    def _per_token_s(self) -> float:
        """Measured seconds per generated token of a running sequence (0 before any step)."""
        return self._interval_s or self._step_s or 0.0

    def refusal(self) -> ServeError | None:
        """The 503 any generation request would get now (starting, draining, queue full)."""
        if self._pending is None or self.draining:
            return ServeError(
                503, "generation is not accepting requests (starting or draining); retry shortly", 1.0
            )
        if len(self._pending) >= self.config.max_queue:
            self.metrics.rejections.labels("generate_queue_full").inc()
            return ServeError(
                503,
                f"generation queue full ({self.config.max_queue}); retry later",
                max(1.0, self.predicted_wait_s()),
            )
        return None

    # -- admission -------------------------------------------------------------------------------

    async def submit(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_eos: bool = True,
        timeout_s: float | None = None,
        logprobs: int | None = None,
    ) -> TokenStream:
        refused = self.refusal()
        if refused is not None:
            raise refused
        n = len(prompt)
        if n < 1:
            raise ServeError(422, "the prompt needs at least one token")
        if any(not (0 <= t < self.loaded.vocab_size) for t in prompt):
            raise ServeError(422, f"token ids must lie in [0, {self.loaded.vocab_size})")
        if n + max_new_tokens > self.decoder.max_len:
            raise ServeError(
                413,
                f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds the model's max_len {self.decoder.max_len}",
            )
        if not (0 < top_p <= 1):
            raise ServeError(422, "top_p must lie in (0, 1]")
        if logprobs is not None and not (0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ServeError(422, f"logprobs must lie in [0, {MAX_TOP_LOGPROBS}]")
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        if not (timeout > 0):
            raise ServeError(422, "timeout_s must be a positive number of seconds")
        now = time.monotonic()
        stream = TokenStream()
        seq = _Seq(
            prompt=list(prompt),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k or 0,
            top_p=top_p,
            seed=seed,
            eos=frozenset(self.loaded.codec.eos_ids) if stop_at_eos else frozenset(),
            logprobs=logprobs,
            deadline=now + timeout,
            stream=stream,
            admitted=now,
        )
        wait = self.predicted_wait_s()
        budget = timeout if self.config.shed_wait_s is None else min(timeout, self.config.shed_wait_s)
        if wait > budget:
            self.metrics.rejections.labels("generate_predicted_wait").inc()
            raise ServeError(
                503,
                f"overloaded: predicted wait for a slot {wait:.2f}s exceeds the budget {budget:.2f}s",
                max(1.0, wait),
            )
        total = wait + max_new_tokens * self._per_token_s()
        limit = self.config.latency_budget_s
        # Only a request that would queue is refused: with a slot free now, refusing cannot make
        # anyone faster, and one slow measured step (x max_new_tokens) would refuse it wrongly.
        queued = bool(self._pending) or all(s is not None for s in self._slots)
        if limit is not None and queued and total > limit:
            self.metrics.rejections.labels("generate_predicted_latency").inc()
            raise ServeError(
                503,
                f"overloaded: predicted latency {total:.2f}s (wait {wait:.2f}s + {max_new_tokens} tokens) "
                f"exceeds the budget {limit:.2f}s",
                max(1.0, wait),
            )
        self._pending.append(seq)
        return stream

    # -- the loop --------------------------------------------------------------------------------

    def _admit_now(self) -> list[tuple[int, _Seq]]:
        """Pending sequences to prefill into free slots now (per the batching policy)."""
        free = [i for i, s in enumerate(self._slots) if s is None]
        if self.config.policy == "static" and len(free) < len(self._slots):
            return []  # a static batch runs to its end before the next one is admitted
        out = []
        now = time.monotonic()
        while free and self._pending:
            seq = self._pending.popleft()
            if seq.stream.cancelled:
                continue
            if now > seq.deadline:
                self.metrics.rejections.labels("generate_deadline").inc()
                seq.stream.close("deadline", ServeError(504, "deadline passed while waiting for a slot"))
                continue
            out.append((free.pop(0), seq))
        return out

    def _prefill_groups(self, admitted: list[tuple[int, _Seq]]) -> list[list[tuple[int, _Seq]]]:
        """Admitted prompts cut into prefill forwards of at most max_prefill_tokens padded tokens."""
        groups: list[list[tuple[int, _Seq]]] = []
        dec = self.decoder
        for item in sorted(admitted, key=lambda a: len(a[1].prompt)):  # similar lengths pad less
            if groups:
                longest = round_up(len(item[1].prompt), dec.prefill_multiple, dec.max_len)
                if (len(groups[-1]) + 1) * longest <= self.config.max_prefill_tokens:
                    groups[-1].append(item)
                    continue
            groups.append([item])
        return groups

    def _prefill(self, group: list[tuple[int, _Seq]]) -> tuple[list[int], list[TokenLogprob | None]]:
        with self._lock, self._autocast():
            logits = self.decoder.prefill([slot for slot, _ in group], [seq.prompt for _, seq in group])
            return self._choose(logits, [seq for _, seq in group], [0] * len(group))

    def _choose(self, logits: Tensor, seqs: list[_Seq | None], steps: list[int]):
        """Sample each row's next token (on the device), then one host copy."""
        rows = len(seqs)

        def col(attr, dtype, default):
            vals = [default if s is None else getattr(s, attr) for s in seqs]
            return torch.tensor(vals, dtype=dtype, device=self.device)

        live = [s for s in seqs if s is not None]
        if all(s.temperature == 0 for s in live):
            # An all-greedy batch is one argmax: no sampling columns to build, no noise, no sort
            # (those cost 8-11 ms per step on a 2-core CPU at 8 x 8192 logits).
            nxt = logits.float().argmax(-1)
        else:
            nxt = sample(
                logits,
                col("temperature", torch.float32, 0.0),
                col("top_k", torch.long, 0),
                col("seed", torch.long, 0),
                torch.tensor(steps, dtype=torch.long, device=self.device),
                col("top_p", torch.float32, 1.0)
                if any(s.top_p < 1 and s.temperature > 0 for s in live)
                else None,
                any_top_k=any(s.top_k > 0 and s.temperature > 0 for s in live),
            )
        want = [s is not None and s.logprobs is not None for s in seqs]
        if not any(want):
            return nxt.tolist(), [None] * rows
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, nxt[:, None])[:, 0].tolist()
        k = max((s.logprobs for s, w in zip(seqs, want) if w), default=0)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        info = [
            TokenLogprob(chosen[r], tuple(zip(top_i[r][: seqs[r].logprobs], top_v[r][: seqs[r].logprobs])))
            if want[r]
            else None
            for r in range(rows)
        ]
        return nxt.tolist(), info

    def _step(self, rows: list[int] | None, tokens: list[int], positions: list[int], seqs: list[_Seq | None]):
        """One decode step over `rows` (None: every slot, the compiled static shape)."""
        # Every tensor is made here, on the compute thread: torch ops from the event-loop thread
        # would start a second OpenMP pool competing for the same cores (2x slower steps here).
        tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        at = None if rows is None else torch.tensor(rows, dtype=torch.long, device=self.device)
        with self._lock, self._autocast():
            logits = self.decoder.decode_one_token(tokens, positions, at)
            return self._choose(logits, seqs, [0 if s is None else s.generated for s in seqs])

    def _emit(self, slot: int, seq: _Seq, token: int, logprob: TokenLogprob | None) -> None:
        if seq.first_token_s is None:
            seq.first_token_s = time.monotonic() - seq.admitted
            self.stats.ttft_s.append(seq.first_token_s)
        seq.stream.put(token, logprob)
        seq.generated += 1
        seq.last_token = token
        self.stats.tokens += 1
        self.metrics.generated_tokens.inc()
        reason = None
        if token in seq.eos:
            reason = "eos"
        elif seq.generated >= seq.max_new_tokens:
            reason = "length"
        elif seq.position + 1 >= self.decoder.max_len:
            reason = "max_len"
        if reason or seq.stream.cancelled:
            seq.stream.close(reason or "cancelled")
            self._slots[slot] = None
            self.stats.finished += 1

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        S = self.config.slots
        while True:
            for group in self._prefill_groups(self._admit_now()):
                try:
                    t0 = time.perf_counter()
                    tokens, info = await loop.run_in_executor(self._executor, self._prefill, group)
                    self._prefill_s = ewma(self._prefill_s, (time.perf_counter() - t0) / len(group))
                except Exception as err:  # a failing prefill fails only its own requests
                    for _, seq in group:
                        seq.stream.close(
                            "error", ServeError(500, f"prefill failed: {type(err).__name__}: {err}")
                        )
                    continue
                self.stats.prefills += len(group)
                self.stats.prefill_batches += 1
                for (slot, seq), token, lp in zip(group, tokens, info):
                    self._slots[slot] = seq
                    seq.position = len(seq.prompt)  # where the first generated token goes
                    self._emit(slot, seq, token, lp)
            active = [(i, s) for i, s in enumerate(self._slots) if s is not None]
            if not active:
                self._last_step_end = None  # an idle gap is not time per token
                if not self._pending:
                    await asyncio.sleep(0.002)  # idle: poll for arrivals (bounded latency, no busy loop)
                continue
            if self.config.compile:  # the static [slots] shape its graphs were compiled for
                rows, seqs = None, list(self._slots)
                tokens, positions = [self.loaded.pad_id] * S, [0] * S
                for i, s in active:
                    tokens[i], positions[i] = s.last_token, s.position
            else:  # eager: only the running slots (idle ones would be computed for nothing)
                rows, seqs = [i for i, _ in active], [s for _, s in active]
                tokens, positions = [s.last_token for s in seqs], [s.position for s in seqs]
            try:
                t0 = time.perf_counter()
                out, info = await loop.run_in_executor(
                    self._executor, self._step, rows, tokens, positions, seqs
                )
                if rows is not None:  # back to slot order
                    nxt, lps = [0] * S, [None] * S
                    for r, t, lp in zip(rows, out, info):
                        nxt[r], lps[r] = t, lp
                    info = lps
                else:
                    nxt = out
                end = time.perf_counter()
                self._step_s = ewma(self._step_s, end - t0)
                if self._last_step_end is not None:
                    self._interval_s = ewma(self._interval_s, end - self._last_step_end)
                self._last_step_end = end
            except Exception as err:
                for i, s in active:
                    s.stream.close("error", ServeError(500, f"decode failed: {type(err).__name__}: {err}"))
                    self._slots[i] = None
                continue
            self.stats.steps += 1
            self.metrics.decode_batch.observe(len(active))
            for i, s in active:
                s.position += 1
                self._emit(i, s, nxt[i], info[i])
