"""The regime matrix (issue 77, docs/studies/regimes.md): DDP against ACCO's default and the paper's step at equal
updates, across the schedules users train with.

    nice -n 19 python examples/nanogpt/regimes.py --T 120            # run what is missing (resumable), then report
    python examples/nanogpt/regimes.py --report-only                  # the table from the records alone

Regimes: ``constant`` (no warm-up, a constant LR: fine-tunes, the demo), ``cosine`` (warm-up 20, cosine to 10%)
and ``wsd`` (warm-up 100, constant, a linear cool-down to 10% over the last 20%), each ``T`` updates long.
First DDP runs at every LR of ``--lrs`` (seed 0) and its best one is the regime's LR; then every method runs at it
on every seed. Each record is one finished run (appended to ``--records``); a rerun skips what is recorded, and a
run cut off is run again from its start. The model, data and loop are those of ``time_to_target.py`` (its
``train_ddp.py`` / ``train_acco.py``, 2 CPU ranks). Pause it while tests or timing benchmarks run:
``sh examples/nanogpt/pause.sh stop`` / ``cont``.

What it reports per cell (mean over seeds): each method's held-out loss after ``T`` updates against DDP's, and
for the constant LR, where no schedule decays, the updates each method needs to reach DDP's final loss, read off
its evaluations (runs of ``--stretch`` x ``T`` updates), interpolated linearly between evaluations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from study import EXACT, PAPER, ROOT, launch, load_records, machine, write_block

# method -> (script, instrument.py's flags). "acco" is the library's default as of this tool (the bf16 estimate
# sent as the change against the weights every rank holds, extrapolated by 1.2 for AdamW): named explicitly, so a
# record keeps meaning what it measured when the default moves on.
METHODS: Dict[str, Tuple[str, List[str]]] = {
    "ddp": ("train_ddp.py", []),
    "acco": ("train_acco.py", ["--acco-option=estimate_dtype=bfloat16", "--acco-option=estimate_extrapolation=1.2"]),
    "acco-paper": ("train_acco.py", [*EXACT]),
    "acco-bf16-paper": ("train_acco.py", ["--acco-option=estimate_dtype=bfloat16", PAPER]),
    "acco-int8": ("train_acco.py", ["--acco-option=compression=int8", "--acco-option=estimate_extrapolation=1.2"]),
}
REGIMES = {  # name -> (schedule, warm-up, share of the run cooling down)
    "constant": ("constant", 0, 0.0),
    "cosine": ("cosine", 20, 0.0),
    "wsd": ("wsd", 100, 0.2),
}
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 32,
         "gradient_accumulation_steps": 4, "eval_iters": 16, "world_size": 2, "min_lr_ratio": 0.1}
RECORDS = ROOT / "docs" / "convergence_data" / "regimes.jsonl"
DOC = ROOT / "docs" / "studies" / "regimes.md"
BEGIN, END = "<!-- regimes:begin -->", "<!-- regimes:end -->"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[120], help="run lengths (updates)")
    p.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    p.add_argument("--methods", nargs="+", default=["ddp", "acco", "acco-paper"], choices=list(METHODS))
    p.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3], help="DDP's LR search (seed 0)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--stretch", type=float, default=1.25, help="constant LR: runs this much longer than T")
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--records", type=Path, default=RECORDS)
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--report-only", action="store_true")
    return p.parse_args(argv)


def length(regime: str, T: int, stretch: float) -> int:
    """The updates a run of ``regime`` at length ``T`` trains: longer at a constant LR (nothing decays at ``T``,
    so the run's evaluation at ``T`` is the length-``T`` run's, and the rest shows when it reaches a target)."""
    return round(T * stretch) if REGIMES[regime][0] == "constant" else T


def overrides(regime: str, T: int, lr: float, seed: int, args: argparse.Namespace) -> List[str]:
    schedule, warmup, cool = REGIMES[regime]
    m = MODEL
    floor = lr if schedule == "constant" else lr * m["min_lr_ratio"]
    return [f"--seed={seed}", f"--learning_rate={lr}", f"--min_lr={floor}",
            f"--schedule={'cosine' if schedule == 'constant' else schedule}", f"--cooldown_iters={round(cool * T)}",
            f"--warmup_iters={warmup}", f"--max_iters={length(regime, T, args.stretch)}",
            f"--n_layer={m['n_layer']}", f"--n_head={m['n_head']}", f"--n_embd={m['n_embd']}",
            f"--block_size={m['block_size']}", f"--batch_size={m['batch_size']}",
            f"--gradient_accumulation_steps={m['gradient_accumulation_steps']}",
            f"--eval_interval={args.eval_interval}", f"--eval_iters={m['eval_iters']}"]


def key(method: str, regime: str, T: int, lr: float, seed: int) -> tuple:
    return (method, regime, int(T), float(lr), int(seed))


def record_key(r: dict) -> tuple:
    return key(r["method"], r["regime"], r["T"], r["lr"], r["seed"])


def run(method: str, regime: str, T: int, lr: float, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    script, flags = METHODS[method]
    out = tmp / f"{method}-{regime}-T{T}-lr{lr:g}-s{seed}"
    for attempt in (1, 2):  # once more: a shared machine can kill a run
        try:
            evals, train, _, wall = launch(script, flags, overrides(regime, T, lr, seed, args), out)
            break
        except RuntimeError as exc:
            if attempt == 2:
                raise
            print(f"{exc}\nretrying once", file=sys.stderr, flush=True)
    val = [[e["iter"], e["val_loss"]] for e in evals]
    at_T = dict(val).get(T)
    if at_T is None:
        raise RuntimeError(f"{method} {regime} T={T}: no evaluation at update {T} (eval interval {args.eval_interval})")
    return {"kind": "regime", "method": method, "regime": regime, "T": T, "lr": lr, "seed": seed,
            "schedule": REGIMES[regime], "model": MODEL, "flags": flags, "val_at_T": at_T, "val": val,
            "train_loss": [t["train_loss"] for t in train], "wall_s": round(wall, 1), **machine()}


def best_lr(records: List[dict], regime: str, T: int, lrs: List[float], seed: int) -> Optional[float]:
    got = {float(r["lr"]): r["val_at_T"] for r in records
           if r["method"] == "ddp" and r["regime"] == regime and r["T"] == T and r["seed"] == seed}
    if not set(lrs) <= set(got):
        return None
    return min(lrs, key=lambda lr: got[lr])


def plan(args: argparse.Namespace, records: List[dict]) -> List[tuple]:
    """What is left to run, in order: DDP's LR search of every cell first, then each cell's methods and seeds."""
    out = [key("ddp", g, T, lr, args.seeds[0]) for T in args.T for g in args.regimes for lr in args.lrs]
    for T in args.T:
        for g in args.regimes:
            lr = best_lr(records, g, T, args.lrs, args.seeds[0])
            if lr is not None:
                out += [key(m, g, T, lr, s) for s in args.seeds for m in args.methods]
    done = {record_key(r) for r in records}
    return [k for k in dict.fromkeys(out) if k not in done]


def run_missing(args: argparse.Namespace) -> None:
    args.records.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="regimes-") as tmp:
        while True:
            todo = plan(args, load_records(args.records))
            if not todo:
                return
            method, regime, T, lr, seed = todo[0]
            print(f"regimes: {len(todo)} run(s) left; {method} {regime} T={T} lr={lr:g} seed={seed}", flush=True)
            record = run(method, regime, T, lr, seed, args, Path(tmp))
            with open(args.records, "a") as f:
                f.write(json.dumps(record) + "\n")


def updates_to(val: List[list], target: float) -> Optional[float]:
    """The first update at which the evaluations reach ``target``, linear between evaluations (None: never)."""
    for (a, la), (b, lb) in zip(val, val[1:]):
        if lb <= target:
            return float(b) if la <= target or la == lb else a + (la - target) / (la - lb) * (b - a)
    return None


def summarize(records: List[dict], args: argparse.Namespace) -> List[dict]:
    """One row per (T, regime, method) with every seed recorded at the regime's LR (DDP's best)."""
    rows = []
    for T in args.T:
        for g in args.regimes:
            lr = best_lr(records, g, T, args.lrs, args.seeds[0])
            if lr is None:
                continue
            cell = {(r["method"], r["seed"]): r for r in records
                    if r["regime"] == g and r["T"] == T and float(r["lr"]) == lr}
            for m in args.methods:
                seeds = [s for s in args.seeds if (m, s) in cell and ("ddp", s) in cell]
                if not seeds:
                    continue
                gaps = [cell[(m, s)]["val_at_T"] / cell[("ddp", s)]["val_at_T"] - 1 for s in seeds]
                row = {"T": T, "regime": g, "lr": lr, "method": m, "seeds": seeds,
                       "gap": statistics.mean(gaps), "gaps": gaps}
                if REGIMES[g][0] == "constant":
                    need = [updates_to(cell[(m, s)]["val"], cell[("ddp", s)]["val_at_T"]) for s in seeds]
                    row["updates"] = [None if n is None else n / T for n in need]
                rows.append(row)
    return rows


def table(rows: List[dict], stretch: float) -> str:
    lines = ["| T | regime (DDP's best LR) | method | seeds | loss at T vs DDP (mean; per seed) | updates to DDP's loss / DDP's (constant LR; per seed) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{g:+.2%}" for g in r["gaps"])
        ups = "" if "updates" not in r else ", ".join(f"> {stretch:.2f}" if u is None else f"{u:.3f}"
                                                       for u in r["updates"])
        lines.append(f"| {r['T']} | {r['regime']} ({r['lr']:g}) | {r['method']} | {len(r['seeds'])} | "
                     f"{r['gap']:+.2%} ({per}) | {ups} |")
    return "\n".join(lines)


def report(args: argparse.Namespace) -> str:
    rows = summarize(load_records(args.records), args)
    block = f"{BEGIN}\n{table(rows, args.stretch)}\n{END}"
    write_block(args.doc, block, BEGIN, END)
    return block


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if not args.report_only:
        run_missing(args)
    print(report(args))


if __name__ == "__main__":
    main()
