"""Data flow: keep the device busy while the next batch is prepared.

    host batches ──(worker pool: decode/augment per sample)──► collate ──► pin ──► bounded queue
          ──► side CUDA stream copy + event ──► training thread (waits on the event, record_stream)

- `Prefetcher` runs any batch iterator on a background thread, `depth` batches ahead (the queue
  is bounded, so a slow consumer stops the producer: backpressure). On CUDA it pins host memory
  and copies on a dedicated stream; the training stream waits on an event and `record_stream`
  keeps the allocator from reusing the buffer while the step still reads it. On CPU it still
  overlaps host-side batch preparation with compute.
- `SampleLoader` turns a map-style dataset (one CPU-heavy sample per index) into batches, with
  the per-sample work spread over a pool of threads or processes.

Shutdown is deterministic: `close()` (called by `break` out of a `for` loop over the iterator,
by an exception, by `with`, or by garbage collection) stops and joins the producer thread and the
worker pool. An exception in a producer reaches the training loop as the same exception object,
its original traceback intact, with a note saying where it was raised.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import torch

from .recipe import RecipeError

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply fn to every tensor of a batch (dict, list, tuple or tensor), keeping dict subclasses and
    their attributes (real_tokens, shape, ...) so metrics still see them."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        out = type(batch)() if type(batch) is not dict else {}
        for k, v in batch.items():
            out[k] = _map_tensors(v, fn)
        if hasattr(batch, "__dict__"):
            out.__dict__.update(batch.__dict__)
        return out
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
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
            batch = _map_tensors(batch, lambda t: t if t.is_pinned() else t.pin_memory())
        with torch.cuda.stream(stream):
            # Asynchronous host-to-device copies on the side stream; the event marks their end.
            batch = _map_tensors(batch, lambda t: t.to(device, non_blocking=True))
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


# ----------------------------------------------------------------------------- worker pools


def _default_collate(samples: list[Any]) -> Any:
    return torch.utils.data.default_collate(samples)


def _sample(dataset: Any, epoch: int, index: int) -> Any:
    """dataset.get(index, epoch) when the dataset varies by epoch (augmentation seeds), else dataset[index]."""
    get = getattr(dataset, "get", None)
    return get(index, epoch) if callable(get) else dataset[index]


class _EpochIndexed(torch.utils.data.Dataset):
    """Indexed by (epoch, index) so persistent worker processes learn the epoch from the index."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return _sample(self.dataset, key[0], key[1])


class _EpochBatches(torch.utils.data.Sampler):
    """Batch sampler re-read at each iter(): the loader's current epoch from its current position."""

    def __init__(self, loader: SampleLoader):
        self.loader = weakref.proxy(loader)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.loader.epoch
        for plan in self.loader.plans()[self.loader.position :]:
            yield [(epoch, i) for i in plan]

    def __len__(self) -> int:
        return len(self.loader.plans()) - self.loader.position


class SampleLoader:
    """Batches from a map-style dataset whose samples are CPU-heavy (decode, augment).

    Each epoch's order is a seeded permutation, cut into `batch_size` batches (the last partial
    batch is dropped so every step has one shape). Samples are prepared by:
    - `workers=0`: the iterating thread itself;
    - `worker_kind="thread"`: a pool of `workers` threads (Pillow and numpy release the GIL while
      decoding and resizing; threads start at once and share the encoded data without copies);
    - `worker_kind="process"`: a torch DataLoader with persistent workers and prefetch, for
      preprocessing that holds the GIL.
    A dataset whose samples vary by epoch (random augmentation) implements `get(index, epoch)`,
    deterministic in both, so every worker kind yields the same batches.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        collate: Callable[[list[Any]], Any] | None = None,
        workers: int = 0,
        worker_kind: Literal["thread", "process"] = "thread",
        seed: int = 0,
        shuffle: bool = True,
        device: torch.device | str = "cpu",
        on_batch: Callable[[Any, float], None] | None = None,
    ):
        if batch_size < 1:
            raise RecipeError(f"batch_size={batch_size} must be >= 1")
        if workers < 0:
            raise RecipeError(f"dataflow.workers={workers} must be >= 0")
        if worker_kind not in ("thread", "process"):
            raise RecipeError(f"dataflow.worker_kind={worker_kind!r}: choose 'thread' or 'process'")
        if len(dataset) < batch_size:
            raise RecipeError(f"the dataset has {len(dataset)} samples, fewer than batch_size={batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate = collate or _default_collate
        self.workers = workers
        self.worker_kind = worker_kind
        self.seed = seed
        self.shuffle = shuffle
        self.device = torch.device(device)
        self.epoch = 0
        self.position = 0
        self._on_batch = on_batch
        # Pools live in a list the finalizer shares, so a loader dropped without close() still joins them.
        self._pools: list[Any] = [None, None]  # [ThreadPoolExecutor, DataLoader]
        self._finalizer = weakref.finalize(self, SampleLoader._release, self._pools)

    def plans(self, epoch: int | None = None) -> list[list[int]]:
        """The index batches of an epoch (deterministic in seed and epoch)."""
        epoch = self.epoch if epoch is None else epoch
        n = len(self.dataset)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        full = n // self.batch_size * self.batch_size
        return [order[a : a + self.batch_size].tolist() for a in range(0, full, self.batch_size)]

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def make_batch(self, plan: Sequence[int], epoch: int | None = None) -> Any:
        """Prepare one batch here (spreading samples over the thread pool when there is one) on the device."""
        return self._to_device(self._host_batch(plan, epoch))

    def _to_device(self, batch: Any) -> Any:
        if self.device.type != "cuda":
            return batch
        # No prefetcher in front of this loader: copy from pinned memory, asynchronously.
        return _map_tensors(batch, lambda t: t.pin_memory().to(self.device, non_blocking=True))

    def _host_batch(self, plan: Sequence[int], epoch: int | None = None) -> Any:
        epoch = self.epoch if epoch is None else epoch
        if self.workers > 0 and self.worker_kind == "thread":
            if self._pools[0] is None:
                self._pools[0] = ThreadPoolExecutor(self.workers, thread_name_prefix="slipstream-worker")
            samples = list(self._pools[0].map(lambda i: _sample(self.dataset, epoch, i), plan))
        else:
            samples = [_sample(self.dataset, epoch, i) for i in plan]
        return self.collate(samples)

    def _process_batches(self) -> Iterator[Any]:
        if self._pools[1] is None:
            self._pools[1] = torch.utils.data.DataLoader(
                _EpochIndexed(self.dataset),
                batch_sampler=_EpochBatches(self),
                collate_fn=self.collate,
                num_workers=self.workers,
                persistent_workers=True,  # no fork + import per epoch
                prefetch_factor=2,
            )
        return iter(self._pools[1])

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        if self.workers > 0 and self.worker_kind == "process":
            batches: Iterator[Any] = self._process_batches()
        else:
            batches = (self._host_batch(p, epoch) for p in self.plans()[self.position :])
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            batch = self._to_device(batch)
            self.position += 1
            if self._on_batch is not None:
                self._on_batch(batch, time.perf_counter() - t0)
            yield batch
        self.epoch += 1
        self.position = 0

    def forever(self) -> Iterator[Any]:
        """Batches across epoch boundaries; closing this generator (break, error) joins the workers."""
        try:
            while True:
                yield from self
        finally:
            self.close()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "items": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed") != self.seed or state.get("items") != len(self.dataset):
            raise RecipeError(
                f"the checkpoint's data order (seed={state.get('seed')}, items={state.get('items')}) does not "
                f"match this dataset (seed={self.seed}, items={len(self.dataset)}); resume with the same data"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    @staticmethod
    def _release(pools: list[Any]) -> None:
        threads, dataloader = pools
        pools[0] = pools[1] = None
        if threads is not None:
            threads.shutdown(wait=True, cancel_futures=True)
        it = getattr(dataloader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # joins the worker processes now, not at some later collection

    def close(self) -> None:
        """Join every worker thread and process. Idempotent; iterating again starts new ones."""
        SampleLoader._release(self._pools)

    def __enter__(self) -> SampleLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Prefetcher", "PrefetchLoader", "SampleLoader", "prefetch"]
