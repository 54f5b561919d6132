"""Tables (markdown) and a plot from overlap.py / hetero.py / memory.py records.

    .venv/bin/python benchmarks/report.py runs/bench/overlap.jsonl runs/bench/hetero.jsonl \\
        runs/bench/memory.jsonl --plot docs/benchmarks_overlap.png

The model columns are the update-time model of ``acco.probe.predict``: with
``x = T_round / T_half`` (``T_half``: one micro-batch, from the compute-only
run; ``T_round``: sync's rounds, which nothing overlaps), acco's utilisation is
``1 / max(1, x)`` and sync's ``2 / (2 + x)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from acco.probe import predict  # noqa: E402


def load(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_point(records):
    points = defaultdict(dict)
    for r in records:
        points[(r["tag"], r["rate_mbit"])][r["label"]] = r
    return points


def fmt_rate(rate) -> str:
    return "loopback" if rate is None else f"{rate:g}"


def t_half(point) -> float:
    c = point["compute"]
    return c["world"] * c["micro_batch"] * c["seq_len"] / c["tokens_per_s"]


def overlap_table(records) -> str:
    rows = ["| rate Mbit/s | T_half ms | T_round ms (sync) | x = T_round/T_half | method | tokens/s | utilisation | "
            "model | round ms | hidden |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (tag, rate), point in sorted(by_point(records).items(), key=lambda kv: -(kv[0][1] or 0)):
        if tag != "overlap" or "compute" not in point or "sync" not in point:
            continue
        th, tr = t_half(point), point["sync"]["summary"]["round_s"]
        pred = predict(th, tr)
        model = {"acco": 2 * th / pred.acco_update_s, "dpu": 2 * th / pred.acco_update_s,
                 "sync": 2 * th / pred.sync_update_s, "compute": 1.0}
        for label, r in point.items():
            s = r.get("summary") or {}
            m = model.get(label)  # variants such as acco:ring0 have no model column
            rounds = f"{s['round_s'] * 1e3:.0f} | {s['hidden']:.2f}" if s.get("rounds") else "|"
            rows.append(
                f"| {fmt_rate(rate)} | {th * 1e3:.0f} | {tr * 1e3:.0f} | {tr / th:.2f} | {label} | {r['tokens_per_s']:.0f} | "
                f"{r['utilisation']:.3f} | {'' if m is None else f'{m:.3f}'} | {rounds} |")
    return "\n".join(rows)


def ratio_table(records) -> str:
    rows = ["| rate Mbit/s | x | acco / ddp-zero | acco / sync | acco (gloo collectives) / acco (ring) | "
            "round ms, gloo collectives -> ring |", "|---|---|---|---|---|---|"]
    for (tag, rate), p in sorted(by_point(records).items(), key=lambda kv: -(kv[0][1] or 0)):
        if tag != "overlap" or not {"compute", "sync", "acco", "ddp-zero"} <= set(p):
            continue
        x = p["sync"]["summary"]["round_s"] / t_half(p)
        a = p["acco"]["tokens_per_s"]
        native = p.get("acco:ring0")
        cells = [fmt_rate(rate), f"{x:.2f}", f"{a / p['ddp-zero']['tokens_per_s']:.2f}", f"{a / p['sync']['tokens_per_s']:.2f}"]
        if native:
            cells += [f"{native['tokens_per_s'] / a:.2f}",
                      f"{native['summary']['round_s'] * 1e3:.0f} -> {p['acco']['summary']['round_s'] * 1e3:.0f}"]
        else:
            cells += ["", ""]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def hetero_table(records) -> str:
    rows = ["| rate Mbit/s | method | tokens/s | vs sync | vs ddp-zero | micro-batches per round, by rank | hidden |",
            "|---|---|---|---|---|---|---|"]
    for (tag, rate), p in sorted(by_point(records).items(), key=lambda kv: -(kv[0][1] or 0)):
        if tag != "hetero":
            continue
        sync, ddp = p.get("sync"), p.get("ddp-zero")
        for label, r in p.items():
            s = r.get("summary") or {"hidden": float("nan")}
            mb = ", ".join(f"{x:.2f}" for x in s.get("microbatches_per_rank", [])) if s.get("rounds") else ""
            rows.append(f"| {fmt_rate(rate)} | {label} | {r['tokens_per_s']:.0f} | "
                        f"{r['tokens_per_s'] / sync['tokens_per_s']:.2f} | {r['tokens_per_s'] / ddp['tokens_per_s']:.2f} | "
                        f"{mb} | {s['hidden']:.2f} |".replace("| nan |", "| |") if sync and ddp else f"| {rate} | {label} | {r['tokens_per_s']:.0f} | | | {mb} | |")
    return "\n".join(rows)


def plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(list)
    for (tag, _rate), p in by_point(records).items():
        if tag != "overlap" or "compute" not in p or "sync" not in p:
            continue
        x = p["sync"]["summary"]["round_s"] / t_half(p)
        for label, r in p.items():
            if label != "compute":
                series[label].append((x, r["utilisation"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in sorted(series.items()):
        pts.sort()
        name = {"acco:ring0": "acco, gloo's own collectives (ACCO_RING=0)", "ddp-zero": "torch DDP + ZeRO"}.get(label, label)
        ax.plot([a for a, _ in pts], [b for _, b in pts], "o-", label=name)
    xs = [i / 100 for i in range(10, 260)]
    ax.plot(xs, [1 / max(1.0, x) for x in xs], "k--", lw=1, label="model: acco 1/max(1, x)")
    ax.plot(xs, [2 / (2 + x) for x in xs], "k:", lw=1, label="model: sync 2/(2+x)")
    ax.set_xlabel("x = T_round / T_half (round time / one micro-batch of compute)")
    ax.set_ylabel("utilisation = tokens/s / compute-only tokens/s")
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("2 ranks, gloo, rate-limited veth (netns); GPT 3.3M params")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def memory_table(records) -> str:
    rows = ["| method | peak RSS MiB (rank 0) | above compute-only MiB | buffers MiB (by the library's / torch's own count) |",
            "|---|---|---|---|"]
    base = next((r["peak_rss_bytes"][0] for r in records if r["label"] == "compute"), None)
    for r in records:
        mem = r.get("memory") or {}
        detail = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in mem.items() if v)
        above = "" if base is None else f"{(r['peak_rss_bytes'][0] - base) / 2**20:.0f}"
        rows.append(f"| {r['label']} | {r['peak_rss_bytes'][0] / 2**20:.0f} | {above} | {detail} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    records = [r for f in args.files for r in load(f)]
    overlap = [r for r in records if r.get("tag") == "overlap"]
    hetero = [r for r in records if r.get("tag") == "hetero"]
    memory = [r for r in records if r.get("tag") == "memory"]
    if overlap:
        print("## Overlap sweep\n\n" + overlap_table(overlap) + "\n\n" + ratio_table(overlap) + "\n")
    if hetero:
        print("## Heterogeneous ranks\n\n" + hetero_table(hetero) + "\n")
    if memory:
        print("## Memory\n\n" + memory_table(memory) + "\n")
    if args.plot and overlap:
        plot(overlap, args.plot)


if __name__ == "__main__":
    main()
