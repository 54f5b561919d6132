"""Spawn helper for multi-rank CPU tests: gloo over a FileStore, with timeouts.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` fresh processes (forked from a server that imported torch) and
returns their results in rank order. A rank that raises makes the call fail at
once with that rank's traceback (the others are killed); a run that outlives
``timeout`` is killed and fails. A bug shows as a failure, never as a hang.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

DEFAULT_TIMEOUT = float(os.environ.get("ACCO_TEST_TIMEOUT", "180"))
PG_TIMEOUT = datetime.timedelta(seconds=60)

# Ranks are forked from one server process that imported torch once (a spawned rank spends seconds importing
# it, a hundred times a suite). Each rank is still a fresh process: nothing of a test's parent state reaches it,
# and the server runs no threads before forking. The server starts at the first run_ranks() with the parent's
# environment of that moment: a worker that needs an environment variable sets it itself.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "acco"])


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=PG_TIMEOUT
        )
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
              may_die: Sequence[int] = ()) -> List[Any]:
    """``may_die``: ranks whose process may end without a result (a fault test's victim): their result is None."""
    results = _CONTEXT.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            _CONTEXT.Process(target=_entry, args=(r, world_size, init_file, fn, args, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size:
                try:
                    rank, status, payload = results.get(timeout=0.5)
                except queue.Empty:
                    for r in may_die:
                        if procs[r].exitcode is not None and r not in out:
                            out[r] = None
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                    if dead:
                        raise AssertionError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f}s")
                    continue
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{payload}")
                out[rank] = torch.load(io.BytesIO(payload), weights_only=True)
                if out[rank] is None and rank in may_die:
                    continue
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=2 if len(out) == world_size else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]


def run_command(cmd: List[str], timeout: float, env: Optional[Dict[str, str]] = None) -> str:
    """Run ``cmd`` (e.g. torchrun) with OMP_NUM_THREADS=1 (and ``env``); return its output, fail on error or
    timeout.

    The command gets a session of its own, so on a timeout it dies with all its
    children (torchrun's ranks) instead of leaving them behind.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{cmd[2:4]} did not finish in {timeout:.0f} s:\n{output[-3000:]}") from None
    assert proc.returncode == 0, output[-6000:]
    return output
