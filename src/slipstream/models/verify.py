"""Checked, not assumed: does this model keep packed documents apart?

A few real documents are laid out exactly as the loader would (one packed row, and each document
alone in its own row), and each document's loss is computed both ways with the model's own forward
(labels of the other documents set to -100). If any differs, the model (or this transformers
version, or this attention backend) lets packed documents see each other or ignores their restarted
positions, and packing would train it on another function: `shapes.mode=pack` is refused and
`auto` falls back to bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from ..shapes.loader import IGNORE_INDEX, collate
from ..shapes.policy import BatchPlan, Segment
from .convention import BatchConvention, loss_of, takes_keyword, unwrap

PACKING_TOLERANCE = 1e-4
"""Relative gap allowed between a document's loss packed and alone (fp32, eval mode)."""
_DOC_TOKENS = (24, 13, 31)
_PAD_COLUMNS = 3  # padding after the packed documents: it must not change their losses either


def _sample_documents(sequences: Sequence) -> list[np.ndarray]:
    """Up to three documents of the user's data (shortened), or random ids when the data are too short."""
    docs = []
    for i in range(min(len(sequences), 200)):
        seq = np.asarray(sequences[i])
        if len(seq) >= 4:
            docs.append(seq[: _DOC_TOKENS[len(docs)]].astype(np.int64))
            if len(docs) == len(_DOC_TOKENS):
                return docs
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n) for n in _DOC_TOKENS]


def _fit_row(docs: list[np.ndarray], extra: int, max_len: int | None) -> tuple[list[np.ndarray], int]:
    """The documents, shortened (longest first, each kept at >= 2 tokens; then fewer of them) so
    that one packed row of them plus its padding columns is at most `max_len` wide: the loader
    never builds a wider row, and a model with max_len positions refuses one (issue 25: a
    68-column probe row made `shapes.mode=pack` look impossible at shapes.max_len=64)."""
    if max_len is None:
        return docs, _PAD_COLUMNS
    docs = list(docs)
    pad = min(_PAD_COLUMNS, max(0, max_len - 2 * (1 + extra)))  # room for two documents first
    budget = max_len - pad
    while (excess := sum(len(d) - 1 + extra for d in docs) - budget) > 0:
        i = max(range(len(docs)), key=lambda j: len(docs[j]))
        if len(docs[i]) > 2:
            docs[i] = docs[i][: max(2, len(docs[i]) - excess)]
        elif len(docs) > 1:  # every document is down to 2 tokens: pack fewer of them
            docs.pop()
        else:
            break
    return docs, pad


def packing_problem(
    model: nn.Module,
    convention: BatchConvention,
    device: torch.device,
    sequences: Sequence = (),
    max_len: int | None = None,
) -> str | None:
    """None when every document's loss packed equals its loss alone, else what differed.

    `max_len`: the widest row the loader will build (shapes.max_len); the probe row stays within it."""
    model = unwrap(model)
    if not takes_keyword(model, convention.packing):
        return f"{type(model).__name__}.forward takes no {convention.packing}"
    docs, pad = _fit_row(_sample_documents(sequences), convention.extra_column, max_len)
    cols = [len(d) - 1 + convention.extra_column for d in docs]
    seq_ids = np.arange(len(docs))
    starts = np.zeros(len(docs), dtype=np.int64)

    def batch(rows: tuple[tuple[Segment, ...], ...], width: int) -> dict[str, torch.Tensor]:
        arrays = collate(BatchPlan(width, rows), docs, seq_ids, starts, 0, True, convention)
        return {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}

    packed = batch((tuple(Segment(i, 0, c) for i, c in enumerate(cols)),), sum(cols) + pad)
    col_of = np.repeat(np.arange(len(docs)), cols)
    was_training = model.training
    model.eval()
    worst = 0.0
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for i, c in enumerate(cols):
                alone = batch(((Segment(i, 0, c),),), c)
                loss_alone = float(loss_of(model(**alone)))
                labels = packed["labels"].clone()
                mine = torch.zeros_like(labels, dtype=torch.bool)
                mine[0, : len(col_of)] = torch.from_numpy(col_of == i).to(device)
                labels[~mine] = IGNORE_INDEX
                loss_packed = float(loss_of(model(**{**packed, "labels": labels})))
                worst = max(worst, abs(loss_packed - loss_alone) / max(1.0, abs(loss_alone)))
    except Exception as err:  # a forward that rejects the packed batch cannot be fed packed rows
        return f"{type(model).__name__} failed on a packed batch ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    if not worst <= PACKING_TOLERANCE:
        return (
            f"{type(model).__name__}'s loss of a document packed with others differs from its loss alone "
            f"by {worst:.1e} (relative): it ignores the packed {convention.packing}, so packed documents "
            "would see each other"
        )
    return None
