"""Launch one benchmark run: one torchrun per rank, each in its own namespace, or one on loopback."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import netns

WORKER = Path(__file__).resolve().parent / "worker.py"


def torchrun_commands(worker_args: Sequence[str], ranks: int, loopback: bool, script: Path = WORKER) -> List[List[str]]:
    """One command per launched process: per rank in its namespace, or one ``--standalone`` on loopback."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if loopback:
        return [run + ["--standalone", "--nproc-per-node", str(ranks), str(script), *worker_args]]
    port = str(random.randint(20000, 40000))
    return [
        netns.exec_prefix(k) + ["env", f"GLOO_SOCKET_IFNAME={netns.IFACE}"] + run
        + ["--nnodes", str(ranks), "--nproc-per-node", "1", "--node-rank", str(k),
           "--master-addr", netns.rank_addr(0), "--master-port", port, str(script), *worker_args]
        for k in range(ranks)
    ]


# the worker's methods that run in one loop only: method -> (that loop, why), for the sweeps and the worker alike
ONE_LOOP = {
    "acco-acc": ("awc", "accumulates while a round is in flight, which only the awc loop "
                        "(accumulate_while_communicating=True) does"),
    "dpu-ef": ("update", "(delay_correction=1.0) needs one step() per update, which only the update loop does"),
}


def loop_refusal(method: str, loop: str) -> Optional[str]:
    """Why ``method`` cannot run in ``loop`` (``ONE_LOOP``), or None."""
    needed, why = ONE_LOOP.get(method, (loop, ""))
    return None if needed == loop else f"{method} {why}"


def check_loop(methods: Sequence[str], loop: str) -> None:
    """Refuse, before any run, a method that ``worker.py`` refuses in ``loop``."""
    for name in [m.partition(":")[0] for m in methods]:
        refusal = loop_refusal(name, loop)
        if refusal:
            sys.exit(f"{refusal}: drop it from --methods or use --loop {ONE_LOOP[name][0]}")


def run_processes(cmds: Sequence[Sequence[str]], env: Optional[Dict[str, str]] = None,
                  timeout: float = 900.0) -> Tuple[List[str], bool]:
    """Run ``cmds`` (``torchrun_commands``) at once, each in its own session with ``OMP_NUM_THREADS=1``; wait for
    all, kill what is left after ``timeout``. Returns each one's output and whether any failed or timed out."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen(list(cmd), env=full_env, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for cmd in cmds]
    logs, failed = [], False
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            logs.append(text)
            failed |= p.returncode != 0
    except subprocess.TimeoutExpired:
        failed = True
        logs.append(f"timed out after {timeout} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return logs, failed


def run_worker(worker_args: Sequence[str], ranks: int, loopback: bool, env: Optional[Dict[str, str]] = None,
               timeout: float = 900.0, script: Path = WORKER) -> dict:
    """Run ``script`` (``worker.py``) on ``ranks`` ranks; return the record rank 0 wrote to ``--out``.
    Raises on failure or timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmds = [cmd + ["--out", str(out)] for cmd in torchrun_commands(worker_args, ranks, loopback, script)]
        logs, failed = run_processes(cmds, env, timeout)
        if not out.exists():
            raise RuntimeError(f"worker {' '.join(worker_args)} failed:\n" + "\n".join(t[-3000:] for t in logs))
        record = json.loads(out.read_text())
        # A record was written after the timed run; a failure at teardown is reported, not hidden.
        record["exit_clean"] = not failed
        return record
