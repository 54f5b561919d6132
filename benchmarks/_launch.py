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
    "acco-auto": ("update", "(compression='auto') compares a round with an update's compute, which only the update "
                            "loop fixes"),
}


def loop_refusal(method: str, loop: str) -> Optional[str]:
    """Why ``method`` cannot run in ``loop`` (``ONE_LOOP``), or None."""
    needed, why = ONE_LOOP.get(method, (loop, ""))
    return None if needed == loop else f"{method} {why}"


def check_loop(methods: Sequence[str], loop: str) -> None:
    """Refuse, before any run, a method that ``worker.py`` refuses in ``loop``."""
    for name in [m.partition("@")[0].partition(":")[0] for m in methods]:
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


def record_row(row: Dict, out: Optional[str]) -> None:
    """Print one run's record and append it to ``out`` (JSON lines), if given."""
    print(json.dumps(row), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def print_speedup(rows: Sequence[Dict], methods: Sequence[str], new: str, old: str) -> None:
    """Each method's tokens/s (median and range over its runs) and ``new``'s over ``old``'s, per repeat (the runs
    interleaved in that order)."""
    import statistics

    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in
              zip([r for r in rows if r["method"] == new], [r for r in rows if r["method"] == old])]
    for method in methods:
        tps = [r["tokens_per_s"] for r in rows if r["method"] == method]
        print(f"{method}: tokens/s median {statistics.median(tps):.0f} ({min(tps):.0f}-{max(tps):.0f})")
    print(f"{new} / {old} tokens/s: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}) over {len(ratios)} repeats")


def two_hosts(script: Sequence[str], loopback: bool) -> List[List[str]]:
    """``script`` under torchrun as two hosts of two ranks: one torchrun of 4 on loopback, else one per namespace
    of ``netns.py`` (``acco-r0``, ``acco-r1``), 2 ranks each, gloo on the namespace's interface."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if loopback:
        return [run + ["--standalone", "--nproc-per-node", "4", *script]]
    port = str(20000 + os.getpid() % 20000)
    return [netns.exec_prefix(k) + ["env", f"GLOO_SOCKET_IFNAME={netns.IFACE}"] + run
            + ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(k), "--master-addr", netns.rank_addr(0),
               "--master-port", port, *script] for k in range(2)]


def testbed_options(p, calibrate: str, smoke: str) -> None:
    """The arguments every testbed benchmark takes: repeats, the rate it records, loopback, its calibration and
    smoke runs (``calibrate``, ``smoke``: what each does), and the records' file."""
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=None, help="the testbed's rate, recorded with each run")
    p.add_argument("--loopback", action="store_true", help="no namespaces: 4 ranks on loopback")
    p.add_argument("--calibrate", action="store_true", help=calibrate)
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--out", default=None, help="JSON lines, one per run (appended)")
