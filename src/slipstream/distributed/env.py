"""The rendezvous environment torchrun sets, the process group, and agreement between ranks.

torchrun (and `slipstream train --nproc N`, which runs it) exports RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT and TORCHELASTIC_RESTART_COUNT; one process sees none of them and runs alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """Another rank died or stopped answering; the message says what to do."""


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    restart_count: int = 0
    """How many times torchrun restarted the workers (--max-restarts): > 0 resumes a checkpoint."""

    @classmethod
    def from_environ(cls) -> DistEnv:
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def local_device(device: torch.device, env: DistEnv) -> torch.device:
    """One GPU per process: rank-local `cuda:LOCAL_RANK` (CPU ranks share the host)."""
    if device.type == "cuda" and env.active:
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    return device


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float) -> None:
    """Join the ranks (env:// rendezvous) once per process: NCCL on GPUs, gloo on CPUs.

    `timeout_s` bounds every collective: a rank that died or hangs ends the others' run with an
    error after at most that long, instead of a hang."""
    if not env.active or dist.is_initialized():
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RankFailure(
            f"WORLD_SIZE={env.world_size} but {', '.join(missing)} not set; start the ranks with "
            "`slipstream train --nproc N` or `torchrun --nproc-per-node N -m slipstream train ...`"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        store=_attempt_store(env, timeout),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=_device_id(device),
    )


def _attempt_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this torchrun attempt.

    After `--max-restarts` restarts the ranks, torchrun's store still holds the dead attempt's
    process-group keys under the same names: restarted gloo ranks read a dead peer's address and
    fail with "connectFullMesh ... Connection refused" (seen here on torch 2.13; pytorch#167288).
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=not agent_hosts and env.rank == 0,
        timeout=timeout,
        multi_tenant=not agent_hosts,
    )
    return dist.PrefixStore(f"slipstream/attempt-{env.restart_count}", store)


def _device_id(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def destroy_process_group(barrier: bool = False) -> None:
    """Leave the process group. `barrier=True` (a run that ended normally on this rank) first waits
    until every rank has reached its teardown, so no rank closes its gloo connections, and exits,
    while a peer may still be exchanging with it (gloo raises a peer's closed connection inside its
    own I/O thread, where it aborts the process). A rank that failed skips it: its peers may be
    dead, and they learn of the failure from their own collectives."""
    if not dist.is_initialized():
        return
    if barrier:
        try:
            dist.barrier()
        except (dist.DistError, RuntimeError):
            pass  # a peer failed after this rank's last collective: nothing is left to wait for
    dist.destroy_process_group()


def agree(value: Any, env: DistEnv) -> Any:
    """Rank 0's `value` on every rank: `auto` decisions are measured on each rank, and ranks that
    picked differently (another dtype, another shape mode) would train different programs."""
    if not env.active or not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_floats(values: list[float], env: DistEnv) -> list[list[float]]:
    """Every rank's `values` (same length on all), on every rank."""
    if not env.active:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    out = [torch.zeros_like(t) for _ in range(env.world_size)]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """The sum over ranks of `t` (in place; returns `t`)."""
    if env.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def rank_failure(err: BaseException, env: DistEnv, timeout_s: float) -> RankFailure:
    """What a rank says when a collective failed: another rank died, hung, or ran out of memory."""
    return RankFailure(
        f"rank {env.rank}/{env.world_size}: a collective with the other ranks failed "
        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no message'}); another rank "
        f"died or stopped answering for {timeout_s:.0f} s (distributed.timeout_s). Its own log says why; "
        "rerun with --resume to continue from the last checkpoint, or let torchrun restart the ranks "
        "(--max-restarts)"
    )
