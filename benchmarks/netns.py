"""A small multi-host network on one machine: one network namespace per rank.

    sudo python benchmarks/netns.py up --ranks 2 --rate-mbit 200
    sudo python benchmarks/netns.py rate --rate-mbit 100
    sudo python benchmarks/netns.py down

Topology: namespace ``acco-br`` holds a Linux bridge; namespace ``acco-rK``
(rank K) holds interface ``acco0`` with address ``10.77.0.(K+1)/24``, one end
of a veth pair whose other end sits on the bridge. Every link has MTU 9000 and
a token-bucket filter (``tc qdisc ... tbf``) on *both* ends, so each rank sends
and receives at most ``rate`` (a full-duplex NIC of that speed). ``netem`` is
not needed (and not in every kernel): no latency is added.

Requires root (``CAP_NET_ADMIN``); says so and exits 2 otherwise. Only the
namespaces named ``acco-*`` that this script creates are touched, and the
benchmarks address nothing but their ``10.77.0.0/24`` addresses.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import List, Sequence

PREFIX = "acco-"
BRIDGE_NS = PREFIX + "br"
IFACE = "acco0"
SUBNET = "10.77.0"
MTU = 9000


def rank_ns(rank: int) -> str:
    return f"{PREFIX}r{rank}"


def rank_addr(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


def exec_prefix(rank: int) -> List[str]:
    """Command prefix that runs a program inside rank ``rank``'s namespace."""
    return ["ip", "netns", "exec", rank_ns(rank)]


def _tbf(ns: str, dev: str, rate_mbit: float, verb: str = "replace") -> List[str]:
    # burst: at least a few jumbo frames and ~2 ms at full rate; the queue holds ~50 ms.
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))
    return ["ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", "tbf",
            "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]


def up_commands(ranks: int, rate_mbit: float) -> List[List[str]]:
    cmds = [["ip", "netns", "add", BRIDGE_NS],
            ["ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", BRIDGE_NS, "link", "set", "br0", "mtu", str(MTU), "up"],
            ["ip", "-n", BRIDGE_NS, "link", "set", "lo", "up"]]
    for r in range(ranks):
        ns, port = rank_ns(r), f"br-r{r}"
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "-n", ns, "link", "add", IFACE, "mtu", str(MTU), "type", "veth",
                  "peer", "name", port, "mtu", str(MTU), "netns", BRIDGE_NS],
                 ["ip", "-n", ns, "addr", "add", f"{rank_addr(r)}/24", "dev", IFACE],
                 ["ip", "-n", ns, "link", "set", IFACE, "up"],
                 ["ip", "-n", BRIDGE_NS, "link", "set", port, "master", "br0", "up"],
                 _tbf(ns, IFACE, rate_mbit),  # what rank r sends
                 _tbf(BRIDGE_NS, port, rate_mbit)]  # what rank r receives
    return cmds


def rate_commands(ranks: int, rate_mbit: float) -> List[List[str]]:
    cmds = []
    for r in range(ranks):
        cmds += [_tbf(rank_ns(r), IFACE, rate_mbit), _tbf(BRIDGE_NS, f"br-r{r}", rate_mbit)]
    return cmds


def existing() -> List[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(PREFIX)]


def down_commands(names: Sequence[str]) -> List[List[str]]:
    return [["ip", "netns", "delete", name] for name in names if name.startswith(PREFIX)]


def require_root() -> None:
    if os.geteuid() != 0:
        sys.exit("benchmarks/netns.py builds network namespaces, veth links and tc qdiscs: it must run as root "
                 "(sudo). Without root, run the benchmarks on loopback with --loopback (no rate limit).")


def run(cmds: Sequence[Sequence[str]], dry_run: bool = False) -> None:
    for cmd in cmds:
        if dry_run:
            print(shlex.join(cmd))
        else:
            subprocess.run(cmd, check=True)


def ranks_up() -> int:
    return sum(1 for name in existing() if name.startswith(PREFIX + "r"))


def up(ranks: int, rate_mbit: float, dry_run: bool = False) -> None:
    """Build the testbed (tearing down a previous one first)."""
    if not dry_run:
        require_root()
        run(down_commands(existing()))
    run(up_commands(ranks, rate_mbit), dry_run)


def set_rate(rate_mbit: float, ranks: int, dry_run: bool = False) -> None:
    if not dry_run:
        require_root()
    run(rate_commands(ranks, rate_mbit), dry_run)


def down() -> None:
    """Delete every ``acco-*`` namespace (and with it its links and qdiscs)."""
    require_root()
    run(down_commands(existing()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="create one namespace per rank, linked through a rate-limited bridge")
    u.add_argument("--ranks", type=int, default=2)
    u.add_argument("--rate-mbit", type=float, default=200.0)
    r = sub.add_parser("rate", help="change every link's rate")
    r.add_argument("--rate-mbit", type=float, required=True)
    sub.add_parser("down", help="delete every acco-* namespace")
    sub.add_parser("status", help="list the acco-* namespaces and their qdiscs")
    for sp in (u, r):
        sp.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    args = p.parse_args(argv)
    if args.cmd == "up":
        if args.ranks < 2:
            p.error(f"--ranks must be at least 2, got {args.ranks}")
        up(args.ranks, args.rate_mbit, args.dry_run)
    elif args.cmd == "rate":
        n = ranks_up() if not args.dry_run else 2
        if n == 0:
            sys.exit("no acco-r* namespaces: run 'netns.py up' first")
        set_rate(args.rate_mbit, n, args.dry_run)
    elif args.cmd == "down":
        down()
    else:
        for name in existing():
            print(name)
            if name != BRIDGE_NS:
                subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", IFACE])


if __name__ == "__main__":
    main()
