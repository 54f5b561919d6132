"""The convergence study of docs/studies/convergence-runs.md: ACCO vs sync ZeRO-1 vs DPU vs torch DDP+ZeRO.

    python examples/gpt/study.py --out runs/study            # all runs (resumable), then tables and plots
    python examples/gpt/study.py --out runs/study --report   # tables and plots from finished runs

Runs one configuration at a time with ``torchrun --nproc_per_node=2`` (CPU,
gloo, one thread per rank). Part 1: every optimizer, equal tokens per update,
seeds 0..2. Part 2: rank 1 slowed 2x; ACCO accumulating (no bound) vs sync.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAIN = ["sync", "acco", "dpu", "torch-zero"]
SLOW = [("sync", []), ("acco", ["--max-microbatches", "0"])]


EXACT = ["--estimate-dtype", "none"]  # the paper's estimate, as the study's records were made (the default is "auto")


def run(out: Path, name: str, args: list, steps: int, eval_every: int) -> Path:
    d = out / name
    if (d / "summary.json").exists():
        return d
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(HERE / "train.py"),
           "--steps", str(steps), "--eval-every", str(eval_every), "--log-every", str(eval_every),
           "--no-progress", "--out", str(d), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return d


def summary(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


def curve(d: Path, key: str):
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r[key], r["eval_loss"]) for r in rows if r["eval_loss"] is not None]


def at(points, x):
    """Eval loss at ``x`` by linear interpolation (None outside the curve)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-12)
    return None


def new_per_handoff(summary: dict, rank: int) -> float:
    """Mean micro-batches a rank computed per hand-off (round).

    A round's count covers the micro-batches in its gradient; in mode acco a
    commit's gradient also holds its estimate's, so those are subtracted.
    """
    counts = summary["microbatches_per_round"][rank]
    if summary["optimizer"] == "acco":
        counts = [c if i % 2 == 0 else c - counts[i - 1] for i, c in enumerate(counts)]
    return sum(counts) / max(1, len(counts))


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else f"{xs[0]:.4f}"


def report(out: Path, seeds, docs: Path) -> str:
    lines = ["## Part 1: equal tokens per update, 2 ranks", "",
             "| optimizer | final eval loss (mean ± std) | gap vs sync | tokens | tokens/s (mean) | runs |",
             "|---|---|---|---|---|---|"]
    sync_mean = None
    for opt in MAIN:
        ds = [out / f"{opt}-s{s}" for s in seeds if (out / f"{opt}-s{s}" / "summary.json").exists()]
        if not ds:
            continue
        finals = [summary(d)["final_eval_loss"] for d in ds]
        m = statistics.mean(finals)
        sync_mean = m if opt == "sync" else sync_mean
        gap = f"{100 * (m - sync_mean) / sync_mean:+.2f}%" if sync_mean else "n/a"
        tps = statistics.mean(summary(d)["tokens_per_s"] for d in ds)
        lines.append(f"| {opt} | {mean_std(finals)} | {gap} | {summary(ds[0])['tokens']:,} | {tps:,.0f} | {len(ds)} |")
    lines += ["", "## Part 2: rank 1 slowed 2x (sleeps as long again as it computed)", "",
              "| optimizer | final eval loss | tokens | wall s | tokens/s | new micro-batches per hand-off (rank 0, rank 1) | "
              "loss at the shared token count | loss at the shared wall time | runs |",
              "|---|---|---|---|---|---|---|---|---|"]
    for opt, _ in SLOW:
        done = [s for s in seeds if (out / f"slow-{opt}-s{s}" / "summary.json").exists()]
        ds = [out / f"slow-{opt}-s{s}" for s in done]
        if not ds:
            continue
        ss = [summary(d) for d in ds]
        # Compare each run with its same-seed partner where both curves exist: at the smaller end point.
        pairs = [(d, out / f"slow-{'acco' if opt == 'sync' else 'sync'}-s{s}") for d, s in zip(ds, done)]
        pairs = [(d, o) for d, o in pairs if (o / "summary.json").exists()]
        at_tok = [at(curve(d, "tokens"), min(summary(d)["tokens"], summary(o)["tokens"])) for d, o in pairs]
        at_time = [at(curve(d, "time"), min(summary(d)["time"], summary(o)["time"])) for d, o in pairs]
        per_rank = [[new_per_handoff(s, rank) for s in ss] for rank in range(len(ss[0]["microbatches_per_round"]))]
        mb_s = ", ".join(f"{statistics.mean(r):.2f}" for r in per_rank)
        lines.append(
            f"| {opt}{' (accumulating)' if opt == 'acco' else ''} | {mean_std([s['final_eval_loss'] for s in ss])} | "
            f"{statistics.mean(s['tokens'] for s in ss):,.0f} | {statistics.mean(s['time'] for s in ss):.1f} | "
            f"{statistics.mean(s['tokens_per_s'] for s in ss):,.0f} | {mb_s} | {mean_std(at_tok)} | {mean_std(at_time)} | {len(ss)} |")
    text = "\n".join(lines) + "\n"
    (out / "tables.md").write_text(text)
    main_runs = [str(out / f"{o}-s{s}") for o in MAIN for s in seeds if (out / f"{o}-s{s}" / "summary.json").exists()]
    slow_runs = [str(out / f"slow-{o}-s{s}") for o, _ in SLOW for s in seeds if (out / f"slow-{o}-s{s}" / "summary.json").exists()]
    plot = [sys.executable, str(HERE / "plot.py")]
    if main_runs:
        subprocess.run(plot + main_runs + ["--out", str(docs / "convergence.png")], check=True)
    if slow_runs:
        subprocess.run(plot + slow_runs + ["--out", str(docs / "convergence_slow.png"),
                                           "--title", "rank 1 slowed 2x: ACCO accumulating vs sync"], check=True)
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/study"))
    p.add_argument("--docs", type=Path, default=Path("docs/studies"), help="where the plots go (the page that shows them)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--report", action="store_true", help="only build tables and plots")
    p.add_argument("--part", choices=["all", "main", "slow"], default="all")
    args = p.parse_args(argv)
    if not args.report:
        if args.part in ("all", "main"):
            for seed in args.seeds:
                for opt in MAIN:
                    run(args.out, f"{opt}-s{seed}", ["--optimizer", opt, "--seed", str(seed), *EXACT], args.steps, args.eval_every)
        if args.part in ("all", "slow"):
            for seed in args.seeds:
                for opt, extra in SLOW:
                    run(args.out, f"slow-{opt}-s{seed}", ["--optimizer", opt, "--seed", str(seed), *EXACT, "--slow-rank", "1",
                                                          "--slow-factor", "2", *extra], args.steps, args.eval_every)
    print(report(args.out, args.seeds, args.docs))


if __name__ == "__main__":
    main()
