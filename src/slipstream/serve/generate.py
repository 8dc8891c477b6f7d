"""Generation for the built-in GPT: prefill + decode over a static KV cache, continuous batching.

The GPT's own forward recomputes the whole prefix; here its parameters are reused (wte, wpe,
blocks[i].ln_1 / attn.qkv / attn.proj / ln_2 / mlp, ln_f, lm_head) with a preallocated cache
`[layers, slots, heads, max_len, head_dim]`, one slot per running sequence:

- `prefill(slot, prompt)`: one forward over the prompt (padded to a multiple of 64 so prompts share
  a few shapes; the padding's keys land beyond the prompt and are masked until overwritten);
- `decode_one_token(tokens, positions)`: every slot advances one token in one [slots, 1] forward
  whose attention reads the cache up to a bucketed key length (multiples of 128) with a mask per
  slot; inactive slots ride along (a static shape), their results ignored.

Continuous (iteration-level) batching: between two decode steps, finished sequences leave and
waiting ones are prefilled into the free slots. Static batching (for comparison): a batch is
admitted only when every slot is free, and runs until its longest sequence ends.

Sampling (greedy, temperature, top-k) runs on the device for the whole batch with Gumbel noise
from a counter-based hash of (seed, step, token id), so a request's tokens depend only on its own
seed and prompt — not on which other requests shared its batch — and no per-request host sync
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
import torch.nn.functional as F
from torch import Tensor

from ..workloads.corpus import EOS_ID, PAD_ID
from .batching import ewma
from .engine import ServeError
from .metrics import ServeMetrics
from .model import LoadedModel

PREFILL_MULTIPLE = 64
KEY_MULTIPLE = 128


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


class KVCache:
    def __init__(self, n_layers: int, slots: int, n_heads: int, max_len: int, head_dim: int, device, dtype):
        shape = (n_layers, slots, n_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)


def _round_up(n: int, m: int, cap: int) -> int:
    return min(cap, -(-n // m) * m)


class Decoder:
    """Prefill and one-token decode over a static KV cache, reusing a GPT's modules."""

    def __init__(self, model, slots: int, dtype: torch.dtype = torch.float32, compile: bool = False):
        cfg = model.config
        self.model = model
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.max_len = cfg.max_len
        self.device = next(model.parameters()).device
        self.cache = KVCache(cfg.n_layers, slots, cfg.n_heads, cfg.max_len, self.head_dim, self.device, dtype)
        self._decode = torch.compile(self._decode_impl, dynamic=False) if compile else self._decode_impl

    def _split_heads(self, t: Tensor) -> Tensor:  # [B, T, C] -> [B, H, T, hd]
        B, T, _ = t.shape
        return t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

    @torch.inference_mode()
    def prefill(self, slot: int, prompt: list[int]) -> Tensor:
        """Fill the slot's cache with the prompt; logits [vocab] of the token after it."""
        n = len(prompt)
        P = _round_up(n, PREFILL_MULTIPLE, self.max_len)
        ids = torch.full((1, P), PAD_ID, dtype=torch.long, device=self.device)
        ids[0, :n] = torch.as_tensor(prompt, dtype=torch.long)
        m = self.model
        x = m.wte(ids) + m.wpe(torch.arange(P, device=self.device))[None]
        for i, block in enumerate(m.blocks):
            h = block.ln_1(x)
            q, k, v = (self._split_heads(t) for t in block.attn.qkv(h).split(h.shape[-1], dim=2))
            self.cache.k[i, slot, :, :P] = k[0]
            self.cache.v[i, slot, :, :P] = v[0]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block.attn.proj(y.transpose(1, 2).reshape(1, P, -1))
            x = x + block.mlp(block.ln_2(x))
        return m.lm_head(m.ln_f(x[0, n - 1]))

    def _decode_impl(self, tokens: Tensor, positions: Tensor, key_len: int) -> Tensor:
        m = self.model
        S = tokens.shape[0]
        slots = torch.arange(S, device=self.device)
        x = (m.wte(tokens) + m.wpe(positions))[:, None]  # [S, 1, C]
        visible = torch.arange(key_len, device=self.device)[None, :] <= positions[:, None]
        mask = visible[:, None, None, :]  # [S, 1, 1, key_len]
        for i, block in enumerate(m.blocks):
            h = block.ln_1(x)
            q, k, v = (self._split_heads(t) for t in block.attn.qkv(h).split(h.shape[-1], dim=2))
            self.cache.k[i, slots, :, positions] = k[:, :, 0].to(self.cache.k.dtype)
            self.cache.v[i, slots, :, positions] = v[:, :, 0].to(self.cache.v.dtype)
            K = self.cache.k[i, :, :, :key_len]
            V = self.cache.v[i, :, :, :key_len]
            y = F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), attn_mask=mask)
            x = x + block.attn.proj(y.transpose(1, 2).reshape(S, 1, -1))
            x = x + block.mlp(block.ln_2(x))
        return m.lm_head(m.ln_f(x[:, 0]))

    @torch.inference_mode()
    def decode_one_token(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions: [slots]; logits [slots, vocab] of each slot's next token."""
        key_len = _round_up(int(positions.max()) + 1, KEY_MULTIPLE, self.max_len)
        return self._decode(tokens, positions, key_len)


def _hash_uniform(seed: Tensor, step: Tensor, vocab: int) -> Tensor:
    """Uniform(0, 1) noise [S, vocab] from (seed, step, token id) alone: batch-independent sampling."""
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)[None, :]
    x = (seed[:, None] * 0x9E3779B1 + step[:, None] * 0x85EBCA77 + ids * 0x2C2B2AE3) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF  # constants < 2**31 keep every product inside int64
    x = x ^ (x >> 15)
    x = (x * 0x6C8E9CF5) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return ((x.double() + 0.5) / 2**32).float().clamp(1e-7, 1 - 1e-7)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, seed: Tensor, step: Tensor) -> Tensor:
    """Next token per row: greedy where temperature == 0, else Gumbel-max over the top-k logits."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp(min=1e-6)[:, None]
    V = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    gumbel = -torch.log(-torch.log(_hash_uniform(seed, step, V)))
    sampled = (scaled + gumbel).argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)


class TokenStream:
    """Async iterator over one request's generated tokens; `finish_reason` is set at the end."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.finish_reason: str | None = None
        self.error: ServeError | None = None
        self.cancelled = False

    def put(self, token: int) -> None:
        self._queue.put_nowait(token)

    def close(self, reason: str, error: ServeError | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self._queue.put_nowait(None)

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
    seed: int
    stop_at_eos: bool
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
    ttft_s: list[float] = field(default_factory=list)
    finished: int = 0


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
        dtype = torch.bfloat16 if self.config.dtype == "bf16" else torch.float32
        self.decoder = Decoder(loaded.model, self.config.slots, dtype, self.config.compile)
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
        self._prefill_s: float | None = None  # EWMA seconds of one prefill (measured)

    def _autocast(self):
        if self.config.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- lifecycle -------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Every prefill length bucket once and every key-length bucket of the decode step once."""
        with self._lock, self._autocast():
            for P in range(PREFILL_MULTIPLE, self.decoder.max_len + 1, PREFILL_MULTIPLE):
                self.decoder.prefill(0, [1] * P)
            S = self.config.slots
            for key_len in range(KEY_MULTIPLE, self.decoder.max_len + KEY_MULTIPLE, KEY_MULTIPLE):
                pos = torch.full(
                    (S,), min(key_len, self.decoder.max_len) - 1, dtype=torch.long, device=self.device
                )
                self.decoder.decode_one_token(torch.ones(S, dtype=torch.long, device=self.device), pos)

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

    def predicted_wait_s(self) -> float:
        """Seconds until a request submitted now would get a slot and its first token.

        Each running sequence frees its slot after its remaining tokens (max_new_tokens is an
        upper bound: EOS may end it sooner, so this errs towards refusing); each queued request
        then takes the earliest free slot for its own max_new_tokens. Steps are priced at the
        measured decode-step time, prefills at the measured prefill time (0 before any is
        measured: nothing is refused on a guess)."""
        if self._step_s is None:
            return 0.0
        free_at = [
            0 if s is None else max(0, s.max_new_tokens - s.generated) for s in self._slots
        ]  # decode steps until each slot frees
        heapq.heapify(free_at)
        prefill = self._prefill_s or 0.0
        waiting = self._pending or ()
        for seq in waiting:  # policy-agnostic: static batching only waits longer
            heapq.heappush(free_at, heapq.heappop(free_at) + seq.max_new_tokens)
        return free_at[0] * self._step_s + (len(waiting) + 1) * prefill

    # -- admission -------------------------------------------------------------------------------

    async def submit(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
        stop_at_eos: bool = True,
        timeout_s: float | None = None,
    ) -> TokenStream:
        if self._pending is None or self.draining:
            raise ServeError(
                503, "generation is not accepting requests (starting or draining); retry shortly", 1.0
            )
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
        now = time.monotonic()
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        stream = TokenStream()
        seq = _Seq(
            list(prompt),
            max_new_tokens,
            temperature,
            top_k or 0,
            seed,
            stop_at_eos,
            now + timeout,
            stream,
            now,
        )
        if not (timeout > 0):
            raise ServeError(422, "timeout_s must be a positive number of seconds")
        wait = self.predicted_wait_s()
        budget = timeout if self.config.shed_wait_s is None else min(timeout, self.config.shed_wait_s)
        if wait > budget:
            self.metrics.rejections.labels("generate_predicted_wait").inc()
            raise ServeError(
                503,
                f"overloaded: predicted wait for a slot {wait:.2f}s exceeds the budget {budget:.2f}s",
                max(1.0, wait),
            )
        if len(self._pending) >= self.config.max_queue:
            self.metrics.rejections.labels("generate_queue_full").inc()
            raise ServeError(
                503, f"generation queue full ({self.config.max_queue}); retry later", max(1.0, wait)
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

    def _prefill(self, slot: int, seq: _Seq) -> Tensor:
        with self._lock, self._autocast():
            return self.decoder.prefill(slot, seq.prompt)

    def _step(self, tokens: Tensor, positions: Tensor, temps, topks, seeds, steps) -> list[int]:
        with self._lock, self._autocast():
            logits = self.decoder.decode_one_token(tokens, positions)
            nxt = sample(logits, temps, topks, seeds, steps)
        return nxt.tolist()  # the one host sync per step: streaming and stop checks need the tokens

    def _sample_one(self, logits: Tensor, seq: _Seq) -> int:
        t = torch.tensor([seq.temperature], device=self.device)
        return int(
            sample(
                logits[None],
                t,
                torch.tensor([seq.top_k], device=self.device),
                torch.tensor([seq.seed], device=self.device),
                torch.tensor([0], device=self.device),
            )[0]
        )

    def _emit(self, slot: int, seq: _Seq, token: int) -> None:
        if seq.first_token_s is None:
            seq.first_token_s = time.monotonic() - seq.admitted
            self.stats.ttft_s.append(seq.first_token_s)
        seq.stream.put(token)
        seq.generated += 1
        seq.last_token = token
        self.stats.tokens += 1
        self.metrics.generated_tokens.inc()
        reason = None
        if seq.generated >= seq.max_new_tokens:
            reason = "length"
        elif seq.stop_at_eos and token == EOS_ID:
            reason = "eos"
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
            for slot, seq in self._admit_now():
                try:
                    t0 = time.perf_counter()
                    logits = await loop.run_in_executor(self._executor, self._prefill, slot, seq)
                    self._prefill_s = ewma(self._prefill_s, time.perf_counter() - t0)
                    token = self._sample_one(logits, seq)
                except Exception as err:  # a failing prefill fails only its own request
                    seq.stream.close("error", ServeError(500, f"prefill failed: {type(err).__name__}: {err}"))
                    continue
                self.stats.prefills += 1
                self._slots[slot] = seq
                seq.position = len(seq.prompt)  # where the first generated token goes
                self._emit(slot, seq, token)
            active = [(i, s) for i, s in enumerate(self._slots) if s is not None]
            if not active:
                if not self._pending:
                    await asyncio.sleep(0.002)  # idle: poll for arrivals (bounded latency, no busy loop)
                continue
            tokens = torch.full((S,), PAD_ID, dtype=torch.long)
            positions = torch.zeros(S, dtype=torch.long)
            temps, topks, seeds, steps = (
                torch.zeros(S),
                torch.zeros(S, dtype=torch.long),
                torch.zeros(S, dtype=torch.long),
                torch.zeros(S, dtype=torch.long),
            )
            for i, s in active:
                tokens[i], positions[i], temps[i] = s.last_token, s.position, s.temperature
                topks[i], seeds[i], steps[i] = s.top_k, s.seed, s.generated
            args = (t.to(self.device) for t in (tokens, positions, temps, topks, seeds, steps))
            try:
                t0 = time.perf_counter()
                nxt = await loop.run_in_executor(self._executor, self._step, *args)
                self._step_s = ewma(self._step_s, time.perf_counter() - t0)
            except Exception as err:
                for i, s in active:
                    s.stream.close("error", ServeError(500, f"decode failed: {type(err).__name__}: {err}"))
                    self._slots[i] = None
                continue
            self.stats.steps += 1
            self.metrics.decode_batch.observe(len(active))
            for i, s in active:
                s.position += 1
                self._emit(i, s, nxt[i])


def generate_reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by re-running model(input_ids) on the whole prefix each step (tests)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.as_tensor([ids], device=next(model.parameters()).device))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]
