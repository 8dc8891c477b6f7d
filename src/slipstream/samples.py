"""Batches of a map-style dataset whose samples are CPU-heavy (decode, augment), with the
per-sample work spread over a pool of threads or processes; `dataflow.prefetch` overlaps them with
the step. Shutdown is deterministic: `close()` (by `with`, `break`, an exception or garbage
collection) joins the worker pool."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import torch

from .dataflow import map_tensors
from .recipe import RecipeError


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
        return map_tensors(batch, lambda t: t.pin_memory().to(self.device, non_blocking=True))

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


__all__ = ["SampleLoader"]
