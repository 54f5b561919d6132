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
import math
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
    "acco-int4": ("train_acco.py", ["--acco-option=compression=int4", "--acco-option=estimate_extrapolation=1.2"]),
    "acco-int8e4": ("train_acco.py", ["--acco-option=compression=int8", "--acco-option=estimate_compression=int4",
                                      "--acco-option=estimate_extrapolation=1.2"]),
    # candidates for a default that holds in every regime (issue 77)
    "acco-h3": ("train_acco.py", ["--acco-option=estimate_dtype=bfloat16", "--acco-option=estimate_extrapolation=1.2",
                                  "--acco-option=estimate_microbatches=3"]),
    "acco-x15": ("train_acco.py", ["--acco-option=estimate_dtype=bfloat16", "--acco-option=estimate_extrapolation=1.5"]),
    # across regions (issue 80): each rank a region of its own running the default's rounds, an outer step
    # (DiLoCo's SGD 0.7, Nesterov 0.9) every 30 updates across the ranks, merged at once
    "regions-h30": ("train_acco.py", ["--regions-of-one", "--acco-option=estimate_dtype=bfloat16",
                                      "--acco-option=estimate_extrapolation=1.2", "--acco-option=outer_every=30"]),
    # ... every 10 updates; every 30 with the outer step a plain average (outer_lr 1, no momentum)
    "regions-h10": ("train_acco.py", ["--regions-of-one", "--acco-option=estimate_dtype=bfloat16",
                                      "--acco-option=estimate_extrapolation=1.2", "--acco-option=outer_every=10"]),
    "regions-h30-avg": ("train_acco.py", ["--regions-of-one", "--acco-option=estimate_dtype=bfloat16",
                                          "--acco-option=estimate_extrapolation=1.2", "--acco-option=outer_every=30",
                                          "--acco-option=outer_lr=1.0", "--acco-option=outer_momentum=0.0"]),
    # 4 ranks, the same global batch (16 sequences per micro-batch): DDP, and 2 regions x 2 ranks with DiLoCo's
    # outer step every 30 updates, or the plain average
    "ddp-4": ("train_ddp.py", []),
    "regions-2x2-h30": ("train_acco.py", ["--regions=2", "--acco-option=estimate_dtype=bfloat16",
                                          "--acco-option=estimate_extrapolation=1.2", "--acco-option=outer_every=30"]),
    "regions-2x2-h30-avg": ("train_acco.py", ["--regions=2", "--acco-option=estimate_dtype=bfloat16",
                                              "--acco-option=estimate_extrapolation=1.2",
                                              "--acco-option=outer_every=30", "--acco-option=outer_lr=1.0",
                                              "--acco-option=outer_momentum=0.0"]),
    # ... every 30 with DiLoCo's outer LR and a lighter momentum (0.5)
    "regions-h30-m5": ("train_acco.py", ["--regions-of-one", "--acco-option=estimate_dtype=bfloat16",
                                         "--acco-option=estimate_extrapolation=1.2", "--acco-option=outer_every=30",
                                         "--acco-option=outer_momentum=0.5"]),
}
# methods on 4 ranks (the rest on 2), each against the DDP of its ranks; the global batch is the same
RANKS = {"ddp-4": 4, "regions-2x2-h30": 4, "regions-2x2-h30-avg": 4}


def ranks(method: str) -> int:
    return RANKS.get(method, 2)


def baseline(method: str) -> str:
    """The DDP a method is held to: the one on as many ranks (DDP's LR search runs on 2)."""
    return "ddp" if ranks(method) == 2 else f"ddp-{ranks(method)}"


def model_of(method: str) -> dict:
    """The run's settings: the model's, with the per-rank batch that keeps the global batch at 2 ranks'."""
    return {**MODEL, "world_size": ranks(method), "batch_size": MODEL["batch_size"] * 2 // ranks(method)}


# method -> its label in the speed benchmark (benchmarks/overlap.py), for the composed time to DDP's loss
SPEED_LABELS = {"ddp": "ddp", "acco": "acco:estimate-bf16", "acco-paper": "acco", "acco-int8": "acco-int8",
                "acco-int4": "acco-int4", "acco-int8e4": "acco-int8e4"}
REGIMES = {  # name -> (schedule, warm-up, share of the run cooling down)
    "constant": ("constant", 0, 0.0),
    "cosine": ("cosine", 20, 0.0),
    "wsd": ("wsd", 100, 0.2),
}
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 32,
         "gradient_accumulation_steps": 4, "eval_iters": 16, "world_size": 2, "min_lr_ratio": 0.1}
RECORDS = ROOT / "docs" / "convergence_data" / "regimes.jsonl"
SPEED = ROOT / "docs" / "benchmarks_data" / "fidelity-speed.jsonl"
DOC = ROOT / "docs" / "studies" / "regimes.md"
GUIDE = ROOT / "docs" / "convergence.md"
BEGIN, END = "<!-- regimes:begin -->", "<!-- regimes:end -->"
MATRIX_BEGIN, MATRIX_END = "<!-- regimes-matrix:begin -->", "<!-- regimes-matrix:end -->"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[120], help="run lengths (updates)")
    p.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    p.add_argument("--methods", nargs="+", default=["ddp", "acco", "acco-paper"], choices=list(METHODS))
    p.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3],
                   help="DDP's LR search at the shortest T (seed 0); a longer T starts from half, once and twice "
                        "the shorter one's best; either goes on by factors of 2 while the best is at an edge")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--stretch", type=float, default=1.25, help="constant LR: runs this much longer than T")
    p.add_argument("--reach", type=float, default=1.03,
                   help="cosine and WSD: every ACCO method also runs round(reach * T) updates, to tell whether it "
                        "reaches DDP's loss within reach x DDP's updates (1 for none)")
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--speed", type=Path, default=SPEED,
                   help="benchmarks/overlap.py records (--tag fidelity-speed) for the composed time to DDP's loss")
    p.add_argument("--records", type=Path, default=RECORDS)
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--guide", type=Path, default=GUIDE, help="where the compact matrix goes")
    p.add_argument("--report-only", action="store_true")
    return p.parse_args(argv)


def decays(regime: str) -> bool:
    return REGIMES[regime][0] != "constant"


def length(regime: str, T: int, stretch: float) -> int:
    """The updates a run of ``regime`` at length ``T`` trains: longer at a constant LR (nothing decays at ``T``,
    so the run's evaluation at ``T`` is the length-``T`` run's, and the rest shows when it reaches a target)."""
    return T if decays(regime) else round(T * stretch)


def overrides(regime: str, n: int, lr: float, seed: int, args: argparse.Namespace, method: str = "ddp") -> List[str]:
    """train_*.py's settings for a run of ``n`` updates under ``regime`` (its schedule spans the ``n``)."""
    schedule, warmup, cool = REGIMES[regime]
    m = model_of(method)
    floor = lr if schedule == "constant" else lr * m["min_lr_ratio"]
    return [f"--seed={seed}", f"--learning_rate={lr}", f"--min_lr={floor}",
            f"--schedule={'cosine' if schedule == 'constant' else schedule}", f"--cooldown_iters={round(cool * n)}",
            f"--warmup_iters={warmup}", f"--max_iters={n}",
            f"--n_layer={m['n_layer']}", f"--n_head={m['n_head']}", f"--n_embd={m['n_embd']}",
            f"--block_size={m['block_size']}", f"--batch_size={m['batch_size']}",
            f"--gradient_accumulation_steps={m['gradient_accumulation_steps']}",
            f"--eval_interval={args.eval_interval}", f"--eval_iters={m['eval_iters']}"]


def key(method: str, regime: str, T: int, lr: float, seed: int, n: int) -> tuple:
    """A run's identity: ``n`` is the updates it trains (``length``, or a reach run's ``round(reach * T)``)."""
    return (method, regime, int(T), float(lr), int(seed), int(n))


def record_key(r: dict, stretch: float) -> tuple:
    return key(r["method"], r["regime"], r["T"], r["lr"], r["seed"], r.get("length") or length(r["regime"], r["T"], stretch))


def run(k: tuple, args: argparse.Namespace, tmp: Path) -> dict:
    method, regime, T, lr, seed, n = k
    script, flags = METHODS[method]
    out = tmp / f"{method}-{regime}-T{T}-n{n}-lr{lr:g}-s{seed}"
    for attempt in (1, 2):  # once more: a shared machine can kill a run
        try:
            evals, train, _, wall = launch(script, flags, overrides(regime, n, lr, seed, args, method), out,
                                           ranks(method))
            break
        except RuntimeError as exc:
            if attempt == 2:
                raise
            print(f"{exc}\nretrying once", file=sys.stderr, flush=True)
    val = [[e["iter"], e["val_loss"]] for e in evals]
    at = dict(val)
    if at.get(T if n == length(regime, T, args.stretch) else n) is None:
        raise RuntimeError(f"{method} {regime} T={T} ({n} updates): no evaluation at its end")
    return {"kind": "regime", "method": method, "regime": regime, "T": T, "length": n, "lr": lr, "seed": seed,
            "schedule": REGIMES[regime], "model": model_of(method), "flags": flags, "val_at_T": at.get(T), "val_at_end": at[n],
            "val": val, "train_loss": [t["train_loss"] for t in train], "wall_s": round(wall, 1), **machine()}


def lr_search(records: List[dict], regime: str, T: int, args: argparse.Namespace) -> Tuple[Optional[float], List[float]]:
    """DDP's best LR for the cell (None while searching) and the LRs still to run (seed 0, runs of length T).
    The grid: ``--lrs`` at the shortest T, else half, once and twice the next shorter T's best; then it doubles
    (halves) while the best is the largest (smallest) LR run, so the best is never at the search's edge."""
    shorter = [t for t in args.T if t < T]
    if shorter:
        b, _ = lr_search(records, regime, max(shorter), args)
        if b is None:
            return None, []
        grid = {b / 2, b, b * 2}
    else:
        grid = set(args.lrs)
    n = length(regime, T, args.stretch)
    got = {float(r["lr"]): r["val_at_T"] for r in records if r["method"] == "ddp" and r["regime"] == regime
           and r["T"] == T and r["seed"] == args.seeds[0] and record_key(r, args.stretch)[5] == n}
    grid |= set(got)
    while True:
        missing = sorted(lr for lr in grid if lr not in got)
        if missing:
            return None, missing
        best = min(grid, key=lambda lr: got[lr])
        if best == max(grid):
            grid.add(best * 2)
        elif best == min(grid):
            grid.add(best / 2)
        else:
            return best, []


def plan(args: argparse.Namespace, records: List[dict]) -> List[tuple]:
    """What is left to run, in order, per T: DDP's LR search of every regime, then each regime's methods on every
    seed, then the reach runs of the decaying regimes."""
    out = []
    for T in args.T:
        search = {g: lr_search(records, g, T, args) for g in args.regimes}  # (best or None, LRs left), once
        for g, (_, missing) in search.items():
            out += [key("ddp", g, T, lr, args.seeds[0], length(g, T, args.stretch)) for lr in missing]
        for g, (best, _) in search.items():
            if best is not None:
                out += [key(m, g, T, best, s, length(g, T, args.stretch)) for s in args.seeds for m in args.methods]
        for g, (best, _) in search.items():
            if best is not None and decays(g) and args.reach > 1:
                out += [key(m, g, T, best, s, round(args.reach * T)) for s in args.seeds for m in args.methods
                        if not m.startswith("ddp")]
    done = {record_key(r, args.stretch) for r in records}
    return [k for k in dict.fromkeys(out) if k not in done]


def run_missing(args: argparse.Namespace) -> None:
    args.records.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="regimes-") as tmp:
        while True:
            todo = plan(args, load_records(args.records))
            if not todo:
                return
            method, regime, T, lr, seed, n = todo[0]
            print(f"regimes: {len(todo)} run(s) left (more may follow a search); {method} {regime} T={T} "
                  f"({n} updates) lr={lr:g} seed={seed}", flush=True)
            record = run(todo[0], args, Path(tmp))
            with open(args.records, "a") as f:
                f.write(json.dumps(record) + "\n")


def updates_to(val: List[list], target: float) -> Optional[float]:
    """The first update at which the evaluations reach ``target``, linear between evaluations (None: never)."""
    for (a, la), (b, lb) in zip(val, val[1:]):
        if lb <= target:
            return float(b) if la <= target or la == lb else a + (la - target) / (la - lb) * (b - a)
    return None


def reach_ratio(at_T: float, at_reach: Optional[float], target: float, reach: float) -> Optional[float]:
    """Under a decaying schedule: the updates to ``target`` over T, from the runs of T and reach x T updates
    (each decayed over its own length), linear between them; 1.0 where the T run already reaches it (an upper
    bound, shown "≤ 1.00"), None where the longer run does not either (beyond ``reach``), NaN while it is not
    recorded yet (shown "…")."""
    if at_T <= target:
        return 1.0
    if at_reach is None:
        return math.nan
    if at_reach > target:
        return None
    return 1 + (reach - 1) * (at_T - target) / (at_T - at_reach)


def speed_ratios(path: Path) -> Dict[float, dict]:
    """rate -> {"x": median x, method: [DDP's tokens/s over the method's, per repeat]} from the speed records."""
    if not path.exists():
        return {}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report  # noqa: PLC0415 (the benchmarks' reader, only for the composed time)

    pts = report.points(report.load(path), "fidelity-speed")
    out: Dict[float, dict] = {}
    for p in (next(iter(pts.values())) if pts else {}).items():
        rate, point = p
        xs = [x for x in point.x() if x]
        row: dict = {"x": statistics.median(xs) if xs else None}
        for method, label in SPEED_LABELS.items():
            if label in point.runs:
                row[method] = [1 / r for r in point.ratio(label, "ddp") if r]
        out[rate] = row
    return out


def summarize(records: List[dict], args: argparse.Namespace) -> List[dict]:
    """One row per (T, regime, method) with every seed recorded at the regime's LR (DDP's best)."""
    rows = []
    speed = speed_ratios(args.speed)
    for T in args.T:
        for g in args.regimes:
            lr, _ = lr_search(records, g, T, args)
            if lr is None:
                continue
            cell = {(r["method"], r["seed"], record_key(r, args.stretch)[5]): r for r in records
                    if r["regime"] == g and r["T"] == T and float(r["lr"]) == lr}
            n, reach_n = length(g, T, args.stretch), round(args.reach * T)
            for m in args.methods:
                base = baseline(m)
                seeds = [s for s in args.seeds if (m, s, n) in cell and (base, s, n) in cell]
                if not seeds:
                    continue
                ddp = {s: cell[(base, s, n)]["val_at_T"] for s in seeds}
                gaps = [cell[(m, s, n)]["val_at_T"] / ddp[s] - 1 for s in seeds]
                if m == base:
                    ups: List[Optional[float]] = [1.0] * len(seeds)
                elif decays(g):
                    ups = [reach_ratio(cell[(m, s, n)]["val_at_T"], (cell.get((m, s, reach_n)) or {}).get("val_at_end"),
                                       ddp[s], reach_n / T) for s in seeds]
                else:
                    ups = [None if u is None else u / T
                           for u in (updates_to(cell[(m, s, n)]["val"], ddp[s]) for s in seeds)]
                rows.append({"T": T, "regime": g, "lr": lr, "method": m, "seeds": seeds,
                             "gap": statistics.mean(gaps), "gaps": gaps, "updates": ups,
                             "composed": composed(ups, speed, m)})
    return rows


def composed(ups: List[Optional[float]], speed: Dict[float, dict], method: str) -> List[tuple]:
    """Per link rate of the speed records: (x, mean updates ratio x median time-per-update ratio, None where a
    seed's updates ratio is unknown or the method was not timed)."""
    out = []
    for rate, row in sorted(speed.items(), key=lambda kv: -kv[0]):
        t = row.get(method)
        ok = t and all(u is not None and not math.isnan(u) for u in ups)
        out.append((row["x"], statistics.mean(ups) * statistics.median(t) if ok else None))
    return out


def fmt_updates(u: Optional[float], bound: float, decaying: bool) -> str:
    if u is None:
        return f"> {bound:.2f}"
    if math.isnan(u):
        return "…"
    return "≤ 1.00" if decaying and u == 1.0 else f"{u:.3f}"


def table(rows: List[dict], args: argparse.Namespace) -> str:
    xs = next((r["composed"] for r in rows if r["composed"]), [])
    head = "".join(f" time to DDP's loss / DDP's at x = {x:.1f} |" for x, _ in xs)
    lines = [f"| T | regime (DDP's best LR) | method | seeds | loss at T vs DDP (mean; per seed) | "
             f"updates to DDP's loss / DDP's (per seed) |{head}", "|---|---|---|---|---|---|" + "---|" * len(xs)]
    for r in rows:
        per = ", ".join(f"{g:+.2%}" for g in r["gaps"])
        bound = args.reach if decays(r["regime"]) else args.stretch
        ups = ", ".join(fmt_updates(u, bound, decays(r["regime"])) for u in r["updates"])
        comp = "".join(" |" if c is None else f" {c:.2f} |" for _, c in r["composed"])
        lines.append(f"| {r['T']} | {r['regime']} ({r['lr']:g}) | {r['method']} | {len(r['seeds'])} | "
                     f"{r['gap']:+.2%} ({per}) | {ups} |{comp}")
    return "\n".join(lines)


def matrix(rows: List[dict], args: argparse.Namespace) -> str:
    """The guide's compact matrix: a row per (T, regime), a column per ACCO method, each cell the mean loss gap at
    T, the mean updates ratio to DDP's loss and the composed time at the speed record's first (fastest) link."""
    methods = [m for m in args.methods if not m.startswith("ddp") and any(r["method"] == m for r in rows)]
    x = next((c[0][0] for c in (r["composed"] for r in rows) if c), None)
    when = f" · time at x = {x:.1f}" if x is not None else ""
    lines = ["| T | regime (DDP's best LR) | seeds | " + " | ".join(f"{m}: loss vs DDP · updates{when}" for m in methods)
             + " |", "|---|---|---|" + "---|" * len(methods)]
    for (T, g, lr) in dict.fromkeys((r["T"], r["regime"], r["lr"]) for r in rows):
        cells, seeds = [], set()
        for m in methods:
            r = next((r for r in rows if (r["T"], r["regime"], r["method"]) == (T, g, m)), None)
            if r is None:
                cells.append("")
                continue
            seeds.add(len(r["seeds"]))
            known = [u for u in r["updates"] if u is not None]
            bound = args.reach if decays(g) else args.stretch
            ups = ("…" if any(math.isnan(u) for u in known) else f"> {bound:.2f}" if len(known) < len(r["updates"]) else
                   "≤ 1.00" if decays(g) and all(u == 1.0 for u in known) else f"{statistics.mean(known):.3f}×")
            t = r["composed"][0][1] if r["composed"] else None
            cells.append(f"{r['gap']:+.2%} · {ups}" + ("" if x is None else " · " + ("–" if t is None else f"{t:.2f}×")))
        lines.append(f"| {T} | {g} ({lr:g}) | {'/'.join(str(n) for n in sorted(seeds))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(args: argparse.Namespace) -> str:
    rows = summarize(load_records(args.records), args)
    block = f"{BEGIN}\n{table(rows, args)}\n{END}"
    write_block(args.doc, block, BEGIN, END)
    if args.guide.exists() and MATRIX_BEGIN in args.guide.read_text():
        write_block(args.guide, f"{MATRIX_BEGIN}\n{matrix(rows, args)}\n{MATRIX_END}", MATRIX_BEGIN, MATRIX_END)
    return block


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if not args.report_only:
        run_missing(args)
    print(report(args))


if __name__ == "__main__":
    main()
