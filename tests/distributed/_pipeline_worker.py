"""Pipeline parity runs, shared by tests/distributed/test_pipeline.py.

`python _pipeline_worker.py OUT.json CASES` spawns 2 gloo processes (1 thread each) that train the
tiny GPT below through PipelineRunner for every case ("schedule:virtual:microbatches", comma
separated) and write the per-step losses and gradient norms to OUT.json. The test runs it in a
subprocess with a timeout, so a P2P hang fails the test instead of blocking the suite.
`reference()` is the single-process loop the runs must match.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

STEPS = 4
ROWS, COLS = 8, 16
LR, CLIP = 3e-3, 0.5  # a clip low enough that it really scales the gradients: tests the global norm


def make_model():
    from slipstream.workloads.gpt import build_gpt

    torch.manual_seed(0)
    return build_gpt("tiny", max_len=COLS, d_model=32, n_layers=4, n_heads=2)


def make_batches() -> list[dict[str, torch.Tensor]]:
    """Fixed global batches. Labels are -100 at random, denser in some rows, so micro-batches hold
    different target counts (a mean of micro-batch means would then differ from the true mean).
    The third batch is packed: two documents per row with restarting position_ids and document_ids."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for step in range(STEPS):
        ids = torch.randint(0, 264, (ROWS, COLS + 1), generator=g)
        labels = ids[:, 1:].clone()
        keep = torch.rand(ROWS, COLS, generator=g) < torch.linspace(0.2, 1.0, ROWS)[:, None]
        labels[~keep] = -100
        batch = {"input_ids": ids[:, :-1].contiguous(), "labels": labels}
        if step == 2:
            cut = torch.randint(3, COLS - 3, (ROWS,), generator=g)
            col = torch.arange(COLS)
            second = col[None, :] >= cut[:, None]
            batch["document_ids"] = second.long()
            batch["position_ids"] = torch.where(second, col[None, :] - cut[:, None], col[None, :])
        batches.append(batch)
    return batches


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def reference() -> dict[str, list[float]]:
    """The plain single-process loop on the same global batches."""
    torch.set_num_threads(1)
    model = make_model()
    opt = make_optimizer(model.parameters())
    losses, norms = [], []
    for batch in make_batches():
        loss = model(**batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def _run_case(rank: int, world: int, schedule: str, virtual: int, microbatches: int) -> dict:
    from slipstream.distributed.pipeline import PipelineRunner, clip_grad_norm_, split_gpt

    stages = split_gpt(make_model(), world, rank, virtual=virtual)
    runner = PipelineRunner(stages, rank, world, schedule=schedule, microbatches=microbatches)
    opt = make_optimizer(runner.parameters())
    losses, norms = [], []
    for batch in make_batches():
        losses.append(runner.step(batch, broadcast_loss=True))
        norms.append(float(clip_grad_norm_(runner, CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "norms": norms}


def _worker(rank: int, world: int, init_file: str, out: str, cases: list[str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for case in cases:
            schedule, virtual, m = case.split(":")
            try:
                results[case] = _run_case(rank, world, schedule, int(virtual), int(m))
            except Exception as e:  # reported per case, so one broken schedule does not hide the rest
                results[case] = {"error": f"{type(e).__name__}: {e}"}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def main(out: str, cases: str) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), out, cases.split(",")), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
