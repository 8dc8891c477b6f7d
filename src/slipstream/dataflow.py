"""Data flow: keep the device busy while the next batch is prepared.

    host batches ──(worker pool: decode/augment per sample)──► collate ──► pin ──► bounded queue
          ──► side CUDA stream copy + event ──► training thread (waits on the event, record_stream)

- `Prefetcher` runs any batch iterator on a background thread, `depth` batches ahead (the queue
  is bounded, so a slow consumer stops the producer: backpressure). On CUDA it pins host memory
  and copies on a dedicated stream; the training stream waits on an event and `record_stream`
  keeps the allocator from reusing the buffer while the step still reads it. On CPU it still
  overlaps host-side batch preparation with compute.
- `samples.SampleLoader` (its own module) turns a map-style dataset (one CPU-heavy sample per
  index) into batches, with the per-sample work spread over a pool of threads or processes.

Shutdown is deterministic: `close()` (called by `break` out of a `for` loop over the iterator,
by an exception, by `with`, or by garbage collection) stops and joins the producer thread (and a
SampleLoader's worker pool). An exception in a producer reaches the training loop as the same exception object,
its original traceback intact, with a note saying where it was raised.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .recipe import RecipeError

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply fn to every tensor of a batch (dict, list, tuple or tensor), keeping dict subclasses and
    their attributes (real_tokens, shape, ...) so metrics still see them."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        out = type(batch)() if type(batch) is not dict else {}
        for k, v in batch.items():
            out[k] = map_tensors(v, fn)
        if hasattr(batch, "__dict__"):
            out.__dict__.update(batch.__dict__)
        return out
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def _each_tensor(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _each_tensor(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _each_tensor(v)


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def _mover(device: torch.device, pin: bool, stream: Any) -> Callable[[Any], tuple[Any, Any]]:
    def move(batch: Any) -> tuple[Any, Any]:
        if device.type != "cuda":
            return batch, None
        if pin:
            batch = map_tensors(batch, lambda t: t if t.is_pinned() else t.pin_memory())
        with torch.cuda.stream(stream):
            # Asynchronous host-to-device copies on the side stream; the event marks their end.
            batch = map_tensors(batch, lambda t: t.to(device, non_blocking=True))
            event = torch.cuda.Event()
            event.record(stream)
        return batch, event

    return move


def _put(q: queue.Queue, stop: threading.Event, item: Any) -> bool:
    """Put with backpressure; gives up (False) when the consumer has closed the prefetcher."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(
    source: Iterable,
    state_of: Callable[[], Any] | None,
    move: Callable[[Any], tuple[Any, Any]],
    q: queue.Queue,
    stop: threading.Event,
) -> None:
    """The producer thread: iterate the source, move each batch, queue it with the source's state."""
    iterator = iter(source)
    try:
        for batch in iterator:
            if stop.is_set():
                return
            state = state_of() if state_of is not None else None
            moved, event = move(batch)
            if not _put(q, stop, (moved, event, state)):
                return
        _put(q, stop, _END)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
        _add_note(exc, "(raised in the slipstream prefetch thread while preparing a batch)")
        _put(q, stop, _Failure(exc))
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()  # generators run their own cleanup (worker pools) on this thread


class Prefetcher:
    """Iterate `source` on a background thread, up to `depth` batches ahead of the consumer.

    `on_batch(batch, wait_s)` is called on the consumer thread with the time the consumer actually
    waited for the batch, which is what `data_wait_s` must measure. With `state_of` (default: the
    source's `state_dict`), the state right after each batch was produced travels with it, and `state_dict()` here returns
    the state of the last batch *consumed* (the producer runs ahead; resuming must not skip batches).
    """

    def __init__(
        self,
        source: Iterable,
        depth: int = 2,
        *,
        device: torch.device | str = "cpu",
        pin_memory: bool = True,
        on_batch: Callable[[Any, float], None] | None = None,
        state_of: Callable[[], Any] | None = None,
        name: str = "slipstream-prefetch",
    ):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise RecipeError(f"dataflow.prefetch_depth={depth!r} must be an integer >= 1")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RecipeError("prefetching to a CUDA device needs CUDA; use runtime.device=cpu")
        self.depth = depth
        self._source = source
        if state_of is None and hasattr(source, "state_dict"):
            state_of = source.state_dict
        self._stateful = state_of is not None
        self._pin = pin_memory and self.device.type == "cuda"
        self._on_batch = on_batch
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._state: Any = state_of() if state_of is not None else None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._done = False
        self.batches = 0
        self.wait_s = 0.0
        # The thread gets what it needs, not `self`: a dropped Prefetcher must be collectable.
        move = _mover(self.device, self._pin, self._stream)
        args = (source, state_of, move, self._queue, self._stop)
        self._thread = threading.Thread(target=_produce, args=args, name=name, daemon=True)
        self._thread.start()
        # A prefetcher dropped without close() still stops its thread when collected.
        self._finalizer = weakref.finalize(self, Prefetcher._shutdown, self._stop, self._queue, self._thread)

    # -- consumer side --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("the prefetch thread stopped without a result") from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc  # the original exception object: its traceback shows the producer's frames
        batch, event, state = item
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in _each_tensor(batch):
                # The batch was allocated on the side stream; tell the allocator the training stream
                # uses it too, so its memory is not handed out again before this step finishes.
                t.record_stream(stream)
        wait = time.perf_counter() - t0
        self.wait_s += wait
        self.batches += 1
        if self._stateful:
            self._state = state
        if self._on_batch is not None:
            self._on_batch(batch, wait)
        return batch

    def state_dict(self) -> Any:
        if not self._stateful:
            raise TypeError("this prefetcher's source has no state_dict()")
        return self._state

    @staticmethod
    def _shutdown(stop: threading.Event, q: queue.Queue, thread: threading.Thread) -> None:
        stop.set()
        while thread.is_alive():
            try:  # drain so a producer blocked on a full queue sees the stop flag
                while True:
                    q.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)

    def close(self) -> None:
        """Stop the producer and join it (and through it, the source's workers). Idempotent."""
        self._done = True
        if threading.current_thread() is not self._thread:
            self._finalizer()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prefetch(
    source: Iterable,
    depth: int = 2,
    *,
    device: torch.device | str = "cpu",
    pin_memory: bool = True,
    on_batch: Callable[[Any, float], None] | None = None,
) -> Iterator[Any]:
    """Generator form of Prefetcher: `break` out of the `for` loop closes it (and joins the thread)."""
    p = Prefetcher(source, depth, device=device, pin_memory=pin_memory, on_batch=on_batch)
    try:
        yield from p
    finally:
        p.close()


class PrefetchLoader:
    """A loader (ShapedLoader, SampleLoader) whose batches are prepared on a background thread.

    Iteration, `forever()` and `state_dict()` go through a Prefetcher; everything else (cfg, plans,
    make_batch, load_state_dict, ...) is the wrapped loader's.
    """

    def __init__(
        self,
        loader: Any,
        depth: int = 2,
        *,
        device: torch.device | str = "cpu",
        pin_memory: bool = True,
        on_batch: Callable[[Any, float], None] | None = None,
    ):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise RecipeError(f"dataflow.prefetch_depth={depth!r} must be an integer >= 1")
        self.loader = loader
        self.depth = depth
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.on_batch = on_batch
        self._active: Prefetcher | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (during unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _run(self, source: Iterable) -> Iterator[Any]:
        if self._active is not None:
            self._active.close()
        p = Prefetcher(
            source,
            self.depth,
            device=self.device,
            pin_memory=self.pin_memory,
            on_batch=self.on_batch,
            state_of=getattr(self.loader, "state_dict", None),
        )
        self._active = p
        try:
            yield from p
        finally:
            p.close()

    def __iter__(self) -> Iterator[Any]:
        return self._run(self.loader)

    def forever(self) -> Iterator[Any]:
        return self._run(self.loader.forever())

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> Any:
        """The wrapped loader's state as of the last batch handed to the loop (not the last produced)."""
        if self._active is not None and self._active.batches > 0:
            return self._active.state_dict()
        return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.close()
        self._active = None
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Stop the prefetch thread and join the wrapped loader's workers."""
        if self._active is not None:
            self._active.close()
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Prefetcher", "PrefetchLoader", "prefetch", "map_tensors"]
