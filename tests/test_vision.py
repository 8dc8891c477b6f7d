"""vision-synthetic: encoded images, deterministic per-sample augmentation, the same loop contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.recipe import DataflowConfig, Recipe, RuntimeConfig
from slipstream.session import Session
from slipstream.workloads import get_workload
from slipstream.workloads.vision import (
    VisionConfig,
    build_cnn,
    collate_images,
    load_vision_data,
    make_vision_loaders,
)

SMALL = VisionConfig(image_size=64, crop_size=32, train_images=96, validation_images=32)


@pytest.fixture(scope="module")
def data():
    return load_vision_data(SMALL)


def test_images_are_stored_encoded_and_decoded_per_sample(data):
    assert len(data.train) == 96 and all(blob[:2] == b"\xff\xd8" for blob in data.train.blobs)  # JPEG
    x, y = data.train.get(5, epoch=0)
    assert x.shape == (3, 32, 32) and x.dtype == np.float32 and 0 <= y < data.num_classes
    again, _ = data.train.get(5, epoch=0)
    other_epoch, _ = data.train.get(5, epoch=1)
    assert np.array_equal(x, again)  # deterministic in (index, epoch): any worker gives the same pixels
    assert not np.array_equal(x, other_epoch)  # and re-augmented every epoch
    v0, _ = data.validation.get(0, 0)
    v1, _ = data.validation.get(0, 7)
    assert np.array_equal(v0, v1)  # validation is not augmented


def test_collate_counts_samples_and_the_model_returns_a_loss(data):
    batch = collate_images([data.train.get(i, 0) for i in range(4)])
    assert batch.real_tokens == 4 and batch.padded_tokens == 0 and batch["images"].shape == (4, 3, 32, 32)
    loss = build_cnn("tiny")(**batch)
    assert loss.shape == () and torch.isfinite(loss)


def test_registered_and_trains_through_session_with_thread_workers_and_prefetch(data):
    wl = get_workload("vision-synthetic")
    assert wl.make_loaders is not None and "tiny" in wl.sizes
    recipe = Recipe(
        runtime=RuntimeConfig(device="cpu", seed=0),
        dataflow=DataflowConfig(prefetch=True, prefetch_depth=2, workers=2, worker_kind="thread"),
    )
    session = Session(recipe)
    model = session.prepare_model(wl.model("tiny", 0))
    opt = session.build_optimizer(model)
    train, validation = make_vision_loaders(session, data, batch_size=16)
    losses = []
    try:
        batches = train.forever()
        for _ in range(12):  # 12 steps of 16 images: 2 epochs of 96
            batch = next(batches)
            with session.autocast():
                loss = model(**batch)
            session.backward(loss)
            session.step(opt)
            losses.append(float(loss.detach()))
    finally:
        train.close()
    assert np.mean(losses[-4:]) < np.mean(losses[:4])
    m = session.metrics()
    assert m.steps == 12 and m.real_tokens == 12 * 16 and m.extra["dataflow_workers"] == 2
    plans = validation.plans(epoch=0)
    assert plans[0] == list(range(16))  # validation in fixed order
    assert validation.make_batch(plans[0])["images"].shape == (16, 3, 32, 32)
