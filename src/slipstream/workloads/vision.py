"""vision-synthetic: a small CNN on images that must be decoded and augmented on the CPU per sample.

The point of this workload is to be data-bound the way real image training is: the images are
generated once (a class-specific shape and colour on a noisy background) and stored *encoded*
(JPEG bytes, as a dataset on disk would be), and every sample is decoded with Pillow and
augmented (random resized crop, flip, brightness) each time it is read. That per-sample CPU work
is what worker pools and prefetching exist to hide.

The model follows the same contract as the GPT: `forward(images, labels) -> mean loss`, so the
batches flow through the same loop (`loss = model(**batch)`).
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageEnhance
from torch import Tensor, nn

from ..shapes.loader import Batch

NUM_CLASSES = 10
_MEAN = np.array([0.5, 0.5, 0.5], dtype=np.float32)
_STD = np.array([0.25, 0.25, 0.25], dtype=np.float32)


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 128
    """Side of the stored (encoded) images in pixels."""
    crop_size: int = 32
    """Side of the augmented crop the model sees."""
    train_images: int = 2048
    """Images in the training split."""
    validation_images: int = 256
    """Images in the validation split."""
    quality: int = 90
    """JPEG quality of the stored images."""


# ----------------------------------------------------------------------------- data


def _render(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    """A noisy background with one shape whose kind and hue depend on the class."""
    base = rng.integers(0, 256, size=3)
    noise = rng.integers(0, 96, size=(size, size, 3), dtype=np.int16)
    pixels = (base[None, None, :] // 2 + 32 + noise).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(img)
    hue = np.array([(label * 97) % 256, (label * 53 + 80) % 256, (label * 31 + 160) % 256])
    color = tuple(int(c) for c in np.clip(hue + rng.integers(-20, 21, size=3), 0, 255))
    r = int(size * rng.uniform(0.2, 0.35))
    cx, cy = (int(v) for v in rng.integers(r, size - r, size=2))
    box = (cx - r, cy - r, cx + r, cy + r)
    kind = label % 5
    if kind == 0:
        draw.ellipse(box, fill=color)
    elif kind == 1:
        draw.rectangle(box, fill=color)
    elif kind == 2:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    elif kind == 3:
        draw.line([(cx - r, cy - r), (cx + r, cy + r)], fill=color, width=max(2, r // 3))
        draw.line([(cx - r, cy + r), (cx + r, cy - r)], fill=color, width=max(2, r // 3))
    else:
        draw.ellipse(box, outline=color, width=max(2, r // 4))
    if label >= 5:  # the second five classes: same shapes with a bar across (shape alone is not enough)
        draw.rectangle((0, cy - 3, size, cy + 3), fill=color)
    return img


class EncodedImages:
    """Images stored as JPEG bytes; `get(i, epoch)` decodes and augments sample i for that epoch.

    Augmentation is seeded by (seed, epoch, i), so any worker kind, in any order, yields the same
    pixels for the same sample and epoch.
    """

    def __init__(
        self, blobs: list[bytes], labels: np.ndarray, crop_size: int, *, augment: bool, seed: int = 0
    ):
        self.blobs = blobs
        self.labels = labels.astype(np.int64)
        self.crop_size = crop_size
        self.augment = augment
        self.seed = seed

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.get(i, 0)

    def get(self, i: int, epoch: int) -> tuple[np.ndarray, int]:
        if not 0 <= i < len(self.blobs):
            raise IndexError(f"image index {i} is out of range for {len(self.blobs)} images")
        img = Image.open(io.BytesIO(self.blobs[i])).convert("RGB")  # JPEG decode (releases the GIL)
        s = self.crop_size
        if self.augment:
            rng = np.random.default_rng([self.seed, epoch, i])
            w, h = img.size
            side = int(min(w, h) * np.sqrt(rng.uniform(0.35, 1.0)))
            x0, y0 = (int(v) for v in rng.integers(0, [w - side + 1, h - side + 1]))
            img = img.resize((s, s), Image.BILINEAR, box=(x0, y0, x0 + side, y0 + side))
            if rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            img = ImageEnhance.Brightness(img).enhance(float(rng.uniform(0.7, 1.3)))
            img = ImageEnhance.Contrast(img).enhance(float(rng.uniform(0.7, 1.3)))
        else:
            img = img.resize((s, s), Image.BILINEAR)
        arr = (np.asarray(img, dtype=np.float32) / 255.0 - _MEAN) / _STD
        return np.ascontiguousarray(arr.transpose(2, 0, 1)), int(self.labels[i])


def collate_images(samples: list[tuple[np.ndarray, int]]) -> Batch:
    """Stack samples into a Batch (model keyword arguments plus host-side counts)."""
    images = torch.from_numpy(np.stack([s[0] for s in samples]))
    labels = torch.tensor([s[1] for s in samples], dtype=torch.int64)
    batch = Batch(images=images, labels=labels)
    # Metrics count "real tokens"; for images one sample is the unit (nothing is padded).
    batch.real_tokens = len(samples)
    batch.padded_tokens = 0
    batch.shape = (len(samples), images.shape[-1])
    return batch


@dataclass(frozen=True)
class VisionData:
    train: EncodedImages
    validation: EncodedImages
    num_classes: int
    encoded_bytes: int
    """Total size of the stored JPEGs."""


def _encode_split(count: int, seed: int, cfg: VisionConfig) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=count)
    blobs = []
    for label in labels:
        buf = io.BytesIO()
        _render(rng, int(label), cfg.image_size).save(buf, format="JPEG", quality=cfg.quality)
        blobs.append(buf.getvalue())
    return blobs, labels


@functools.lru_cache(maxsize=4)
def load_vision_data(cfg: VisionConfig = VisionConfig(), seed: int = 0) -> VisionData:
    """Generate and encode the images once per process (a few seconds for the default sizes)."""
    train_blobs, train_labels = _encode_split(cfg.train_images, seed, cfg)
    val_blobs, val_labels = _encode_split(cfg.validation_images, seed + 1, cfg)
    return VisionData(
        train=EncodedImages(train_blobs, train_labels, cfg.crop_size, augment=True, seed=seed),
        validation=EncodedImages(val_blobs, val_labels, cfg.crop_size, augment=False, seed=seed),
        num_classes=NUM_CLASSES,
        encoded_bytes=sum(map(len, train_blobs)) + sum(map(len, val_blobs)),
    )


BATCH_SIZE = 64
"""Images per step (one shape for every step: the last partial batch of an epoch is dropped)."""


def make_vision_loaders(session: Any, data: VisionData, batch_size: int = BATCH_SIZE) -> tuple[Any, Any]:
    """Training batches through session.prepare_samples (recipe.dataflow: workers, prefetch) and a
    validation loader in fixed order without augmentation (plans + make_batch, like ShapedLoader)."""
    from ..samples import SampleLoader

    train = session.prepare_samples(data.train, batch_size, collate=collate_images)
    validation = SampleLoader(
        data.validation, min(batch_size, len(data.validation)), collate=collate_images, shuffle=False,
        device=session.device,
    )  # fmt: skip
    return train, validation


# ----------------------------------------------------------------------------- model

CNN_SIZES: dict[str, tuple[int, ...]] = {
    "tiny": (8, 16, 32),
    "small": (16, 32, 64),
}


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(c_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU-pool blocks, global average pool, linear classifier; forward returns the loss."""

    def __init__(self, channels: tuple[int, ...] = CNN_SIZES["small"], num_classes: int = NUM_CLASSES):
        super().__init__()
        widths = (3, *channels)
        self.blocks = nn.ModuleList(ConvBlock(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(channels[-1], num_classes)

    def logits(self, images: Tensor) -> Tensor:
        x = images
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))

    def forward(self, images: Tensor, labels: Tensor | None = None) -> Tensor:
        logits = self.logits(images)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels)


def build_cnn(size: str = "small") -> SmallCNN:
    if size not in CNN_SIZES:
        raise ValueError(f"vision-synthetic has no size {size!r}; choose one of {', '.join(CNN_SIZES)}")
    return SmallCNN(CNN_SIZES[size])


__all__ = [
    "CNN_SIZES",
    "EncodedImages",
    "SmallCNN",
    "VisionConfig",
    "VisionData",
    "build_cnn",
    "collate_images",
    "load_vision_data",
    "make_vision_loaders",
]
