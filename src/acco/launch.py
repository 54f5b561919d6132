"""Process-group start-up that survives ``torchrun --max-restarts``."""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["init_process_group"]


def init_process_group(backend: Optional[str] = None, timeout: Optional[datetime.timedelta] = None) -> None:
    """``dist.init_process_group`` from torchrun's environment, safe across restarts. Collective.

    ``backend`` defaults to NCCL when CUDA is available, else gloo (then each
    rank also takes ``cuda:LOCAL_RANK``). Under torchrun the workers share the
    agent's store; after a restart (``--max-restarts``) the previous attempt's
    keys are still there and gloo would connect to dead peers, so the store is
    prefixed with the restart count. That count differs between hosts after one
    host's failure, so several nodes with ``--max-restarts`` are refused unless
    torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store
    per restart, where the plain ``dist.init_process_group`` is right).
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs = {} if timeout is None else {"timeout": timeout}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, **kwargs)
        return
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "acco.init_process_group(): torchrun with several nodes and --max-restarts shares one store across "
            "restarts, and after one host's failure the hosts' workers restart with different restart counts, so "
            "they cannot agree which keys are stale and would wait for each other until the timeout. Launch "
            "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (every restart then gets a fresh "
            "store; docs/cluster.md)."
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout or datetime.timedelta(minutes=5))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"acco/attempt_{attempt}", store), rank=rank,
                            world_size=world, **kwargs)
