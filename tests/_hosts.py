"""Two "hosts" on one machine: network namespaces joined by a veth pair, for multi-host torchrun tests.

``acco-h0`` holds ``acco-h0v`` at 10.78.0.1/24, ``acco-h1`` holds ``acco-h1v`` at 10.78.0.2/24, the two ends of
one veth pair. Only these namespaces, created here, are touched. Needs root (CAP_NET_ADMIN) and ``ip``;
:func:`unavailable` says why not, for the skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

HOSTS = ("acco-h0", "acco-h1")
IFACES = ("acco-h0v", "acco-h1v")
ADDRS = ("10.78.0.1", "10.78.0.2")


def unavailable() -> Optional[str]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces): run make test as root"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` for network namespaces"
    return None


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


def down() -> None:
    for ns in HOSTS:
        _ip("netns", "del", ns, check=False)


def up() -> None:
    down()
    for ns in HOSTS:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
    _ip("link", "add", IFACES[0], "type", "veth", "peer", "name", IFACES[1])
    for ns, iface, addr in zip(HOSTS, IFACES, ADDRS):
        _ip("link", "set", iface, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
        _ip("-n", ns, "link", "set", iface, "up")


def torchrun(host: int, script: List[str], *, nnodes: str = "2", max_restarts: int = 0, rdzv_id: str = "acco-test",
             port: int = 29611, extra_env: Optional[Dict[str, str]] = None, rdzv_conf: str = "",
             log=None) -> subprocess.Popen:
    """``torchrun`` on host ``host``: one worker, c10d rendezvous at host 0's address (``rdzv_conf``: more
    ``key=value,...`` settings of it). Its own session (killed with its workers on a timeout)."""
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: each rendezvous round gets a fresh store (docs/cluster.md)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": IFACES[host],
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(extra_env or {})}
    cmd = ["ip", "netns", "exec", HOSTS[host], sys.executable, "-m", "torch.distributed.run",
           f"--nnodes={nnodes}", "--nproc-per-node=1", f"--max-restarts={max_restarts}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={ADDRS[0]}:{port}", f"--rdzv-id={rdzv_id}",
           # is_host: inside a namespace torchrun cannot tell that the endpoint is its own address
           f"--rdzv-conf=is_host={int(host == 0)}" + (f",{rdzv_conf}" if rdzv_conf else ""),
           f"--local-addr={ADDRS[host]}", "--monitor-interval=0.5", *script]
    return subprocess.Popen(cmd, env=env, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def workers(agent: subprocess.Popen) -> List[int]:
    """The worker processes of a torchrun agent (its python children)."""
    out = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def wait_all(procs: List[subprocess.Popen], timeout: float) -> None:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            kill_all(procs)
            raise AssertionError(f"torchrun did not finish in {timeout:.0f} s") from None


def kill_all(procs: List[subprocess.Popen]) -> None:
    """The agents and their workers (torchrun starts workers in sessions of their own: killed one by one)."""
    for q in procs:
        for pid in workers(q):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(q.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
