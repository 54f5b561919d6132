"""Plot eval loss vs tokens and vs wall-clock for several runs of train.py.

    python examples/gpt/plot.py runs/acco-s0 runs/sync-s0 ... --out docs/studies/convergence.png

Runs with the same label (the summary's optimizer, plus "slow" when a rank was
slowed) are averaged point by point, with a band of one standard deviation.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(run: Path):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run / "summary.json").read_text())
    evals = [r for r in rows if r["eval_loss"] is not None]
    return summary, evals


def label_of(summary) -> str:
    label = summary["optimizer"]
    if summary.get("slow_rank", -1) >= 0:
        label += f" (rank {summary['slow_rank']} {summary['slow_factor']:g}x slower"
        if summary["optimizer"] != "torch-zero" and summary.get("max_microbatches", 1) != 1:
            label += ", accumulating"
        label += ")"
    return label


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default="GPT on byte-level text, 2 CPU ranks")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = defaultdict(list)
    for run in args.runs:
        summary, evals = load(run)
        groups[label_of(summary)].append(evals)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, runs in sorted(groups.items()):
        n = min(len(r) for r in runs)
        for ax, key in zip(axes, ("tokens", "time")):
            x = np.mean([[e[key] for e in r[:n]] for r in runs], axis=0)
            y = np.array([[e["eval_loss"] for e in r[:n]] for r in runs])
            line = ax.plot(x, y.mean(0), marker=".", label=f"{label} (n={len(runs)})")[0]
            if len(runs) > 1:
                ax.fill_between(x, y.mean(0) - y.std(0), y.mean(0) + y.std(0), color=line.get_color(), alpha=0.2)
    axes[0].set_xlabel("tokens (all ranks)")
    axes[1].set_xlabel("wall-clock seconds (evaluation excluded)")
    for ax in axes:
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
