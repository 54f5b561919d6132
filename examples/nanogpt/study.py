"""The learning-rate study of docs/studies/lr-study.md: can I keep my DDP learning rate?

    python examples/nanogpt/study.py                 # run what is missing (resumable), then report
    python examples/nanogpt/study.py --report-only   # tables and plots from the records alone

Every run is the nanoGPT-style loop of this folder under
``torchrun --standalone --nproc_per_node=2`` (CPU, gloo, one thread per rank):
``train_ddp.py`` for DDP + AdamW, ``train_acco.py`` for the ``AccoOptimizer``
modes. A finished run appends one JSON line to ``--records``; a run whose
line is there is not run again, so a killed study picks up where it stopped
(the run in flight starts over). The report reads the records and nothing
else: every record of the configuration whose method the tool knows, whatever
``--methods``, ``--lrs`` or ``--seeds`` name. The tables go between the
study's markers in ``--doc``, the plots
beside it. ``--doc`` defaults to docs/studies/lr-study.md, and with
``--optimizer muon`` to docs/studies/muon-study.md (docs/convergence.md, the
guide, sums both up).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# method -> (script, its settings, instrument.py's flags). ``--estimate-gap`` logs |theta~ - theta| and
# |theta_t+1 - theta_t| after every update; ``--acco-option`` passes an AccoOptimizer option (the remedies).
GAP = "--estimate-gap"
# the paper's step and its exact estimate, as the records were made (the defaults are "auto": a bf16 estimate, and for
# AdamW extrapolated)
PAPER = "--acco-option=estimate_extrapolation=1.0"
EXACT = ["--acco-option=estimate_dtype=None", PAPER]
METHODS: Dict[str, Tuple[str, List[str], List[str]]] = {
    "ddp": ("train_ddp.py", [], []),
    "acco": ("train_acco.py", [], [GAP, *EXACT]),
    "dpu": ("train_acco.py", ["--mode=dpu"], [GAP]),
    # mode dpu with its error feedback at the setting of Zmushko et al. (2026): delay_correction=1.0
    "dpu-ef": ("train_acco.py", ["--mode=dpu"], [GAP, "--acco-option=delay_correction=1.0"]),
    "sync": ("train_acco.py", ["--mode=sync"], []),
    "acco-sync20": ("train_acco.py", [], [GAP, *EXACT, "--acco-option=synchronous_updates=20"]),
}
def markers(name: str):
    """The report's markers in the doc: ``lr-study`` (AdamW) or ``muon-study`` (``--optimizer muon``)."""
    return f"<!-- {name}:begin (written by examples/nanogpt/study.py) -->", f"<!-- {name}:end -->"


BEGIN, END = markers("lr-study")
NEAR_BEST = 0.05  # DDP is "near its best" at an LR where every seed ends within 5% of DDP's best mean
STABLE_AFTER, STABLE_RISE = 50, 0.01  # "stable": after update 50 no held-out evaluation rises by more than 1%
CLOSE = 0.01  # "within 1% of DDP"
# Run after every seed of the others: DPU, the uncompensated reference (not a candidate for the default).
LATE = ("dpu", "dpu-ef")
# The remedies run at --remedy-lrs only: where ACCO trails DDP (DDP's best LRs), not where it is ahead.
REMEDIES = ("acco-sync20",)


# ----------------------------------------------------------------------------- running


def config_of(args: argparse.Namespace) -> dict:
    """What makes two runs comparable (besides method, LR and seed): part of every record."""
    return {
        "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "block_size": args.block_size,
        "batch_size": args.batch_size, "gradient_accumulation_steps": args.accum, "max_iters": args.iters,
        "warmup_iters": args.warmup, "min_lr_ratio": args.min_lr_ratio, "eval_interval": args.eval_interval,
        "eval_iters": args.eval_iters, "world_size": 2,
        # the Muon + AdamW study's LRs are Muon's; its AdamW groups run at adamw_lr (AdamW records lack these keys)
        **({"optimizer": "muon", "adamw_lr": args.adamw_lr} if args.optimizer == "muon" else {}),
    }


def plan(args: argparse.Namespace) -> List[Tuple[str, float, int]]:
    """The runs, most informative first: once DDP's first seed has found its best LR, every seed of every
    candidate there (the question's answer and the remedies' test); the first seed everywhere; the other seeds;
    last ``LATE``: the uncompensated reference (DPU)."""
    runs = [(m, lr, seed) for seed in args.seeds for m in args.methods for lr in args.lrs
            if (m not in LATE or seed in args.dpu_seeds) and (m not in REMEDIES or lr in args.remedy_lrs)]
    first = args.seeds[0]
    focus = focus_lr(args)  # DDP's best LR on the first seed: its other seeds come first, the question's answer
    late = {m: i + 1 for i, m in enumerate(LATE)}
    return sorted(runs, key=lambda r: (late.get(r[0], 0), r[1] != focus, r[2] != first, r[2], args.methods.index(r[0]), r[1]))


def focus_lr(args: argparse.Namespace) -> Optional[float]:
    """DDP's best LR over the first seed's records (None until DDP's first seed is complete)."""
    config = json.dumps(config_of(args), sort_keys=True)
    first = {float(r["lr"]): r["final_val_loss"] for r in load_records(args.records)
             if r["method"] == "ddp" and int(r["seed"]) == args.seeds[0] and json.dumps(r["config"], sort_keys=True) == config}
    if set(first) != set(args.lrs):
        return None
    return min(first, key=first.get)


def load_records(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def key(record_or_run, config: Optional[dict] = None) -> tuple:
    if isinstance(record_or_run, dict):
        r = record_or_run
        return (r["method"], float(r["lr"]), int(r["seed"]), json.dumps(r["config"], sort_keys=True))
    method, lr, seed = record_or_run
    return (method, float(lr), int(seed), json.dumps(config, sort_keys=True))


def launch(script: str, flags: List[str], overrides: List[str], out: Path,
           ranks: int = 2) -> Tuple[list, list, Optional[list], float]:
    """One run of ``script`` under torchrun (``ranks`` CPU ranks, one thread each), through ``instrument.py`` with
    ``flags``; returns its held-out evaluations, its per-update training log, the estimate-gap log (or None) and
    its wall-clock seconds. Raises if the run fails."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(HERE / "instrument.py"), *flags, str(HERE / script), f"--out_dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"run failed (exit {proc.returncode}):\n$ {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    evals = json.loads((out / "log.json").read_text())
    train = json.loads((out / "train_log.json").read_text())
    gap_file = out / "estimate_gap.json"
    gaps = json.loads(gap_file.read_text()) if gap_file.exists() else None
    return evals, train, gaps, wall


def machine() -> dict:
    """Where a record was made."""
    import torch  # noqa: PLC0415 (only for the version in the record)

    return {"torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
            "date": datetime.date.today().isoformat()}


def run_one(method: str, lr: float, seed: int, config: dict, workdir: Path) -> dict:
    """One training run; returns its record (raises if the run fails)."""
    script, extra, flags = METHODS[method]
    base = config.get("adamw_lr", lr)  # with Muon: lr is Muon's, the schedule's base (learning_rate) AdamW's
    muon = ["--optimizer_name=muon", f"--muon_lr={lr}"] if config.get("optimizer") == "muon" else []
    overrides = [
        f"--seed={seed}", f"--learning_rate={base}", f"--min_lr={base * config['min_lr_ratio']}", *muon,
        f"--n_layer={config['n_layer']}", f"--n_head={config['n_head']}", f"--n_embd={config['n_embd']}",
        f"--block_size={config['block_size']}", f"--batch_size={config['batch_size']}",
        f"--gradient_accumulation_steps={config['gradient_accumulation_steps']}",
        f"--max_iters={config['max_iters']}", f"--warmup_iters={config['warmup_iters']}",
        f"--eval_interval={config['eval_interval']}", f"--eval_iters={config['eval_iters']}", *extra,
    ]
    try:
        evals, train, gaps, wall = launch(script, flags, overrides, workdir / f"{method}-lr{lr:g}-s{seed}")
    except RuntimeError as exc:
        raise RuntimeError(f"run {method} lr={lr:g} seed={seed}: {exc}") from None
    return {
        "method": method, "lr": lr, "seed": seed, "config": config,
        "final_val_loss": evals[-1]["val_loss"],
        "val": [[e["iter"], e["val_loss"]] for e in evals],
        "train_loss": [t["train_loss"] for t in train],
        "estimate_gap": [g["estimate_gap"] for g in gaps] if gaps else None,
        "update_norm": [g["update_norm"] for g in gaps] if gaps else None,
        "wall_s": round(wall, 1),
        "tokens_per_update": config["batch_size"] * config["block_size"] * config["gradient_accumulation_steps"] * 2,
        **machine(),
    }


def run_missing(args: argparse.Namespace) -> None:
    config = config_of(args)
    done = {key(r) for r in load_records(args.records)}
    todo = [r for r in plan(args) if key(r, config) not in done]
    print(f"lr study: {len(plan(args)) - len(todo)} runs recorded, {len(todo)} to run -> {args.records}", flush=True)
    args.records.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lr-study-") as tmp:
        for i, (method, lr, seed) in enumerate(todo):
            try:
                record = run_one(method, lr, seed, config, Path(tmp))
            except RuntimeError as exc:  # once more: a shared machine can kill a run (the study is hours long)
                print(f"{exc}\nretrying once", file=sys.stderr, flush=True)
                record = run_one(method, lr, seed, config, Path(tmp))
            with open(args.records, "a") as f:
                f.write(json.dumps(record) + "\n")  # one line per finished run: the study resumes from here
            print(f"[{i + 1}/{len(todo)}] {method} lr={lr:g} seed={seed}: final held-out loss "
                  f"{record['final_val_loss']:.4f} ({record['wall_s']:.0f} s)", flush=True)


# ----------------------------------------------------------------------------- the report (records only)


def finite(x) -> bool:
    return x is not None and math.isfinite(x)


def table_of(records: List[dict]) -> Dict[str, Dict[float, List[dict]]]:
    """method -> lr -> records (sorted by seed)."""
    out: Dict[str, Dict[float, List[dict]]] = {}
    for r in records:
        out.setdefault(r["method"], {}).setdefault(float(r["lr"]), []).append(r)
    for by_lr in out.values():
        for rs in by_lr.values():
            rs.sort(key=lambda r: r["seed"])
    return out


def mean_loss(rs: List[dict]) -> float:
    losses = [r["final_val_loss"] for r in rs]
    return statistics.fmean(losses) if all(finite(x) for x in losses) else math.inf


def paired_gaps(a: List[dict], b: List[dict]) -> List[float]:
    """Per seed (same init and data in both): (a - b) / b of the final held-out loss."""
    bs = {r["seed"]: r["final_val_loss"] for r in b}
    return [(r["final_val_loss"] - bs[r["seed"]]) / bs[r["seed"]] for r in a if r["seed"] in bs]


def stable_run(r: dict) -> bool:
    """No divergence: finite, and after update STABLE_AFTER no held-out evaluation rises by more than 1%."""
    vals = [v for it, v in r["val"] if it >= STABLE_AFTER]
    return all(finite(v) for v in vals) and all(b <= a * (1 + STABLE_RISE) for a, b in zip(vals, vals[1:]))


def summarize(records: List[dict]) -> dict:
    """Every number the report prints, computed from the records alone."""
    t = table_of(records)
    if "ddp" not in t:
        raise SystemExit("no DDP records: the report compares every method to DDP")
    lrs = sorted({lr for by_lr in t.values() for lr in by_lr})
    ddp = t["ddp"]
    ddp_best_lr = min(ddp, key=lambda lr: mean_loss(ddp[lr]))
    ddp_best = mean_loss(ddp[ddp_best_lr])
    near = [lr for lr in sorted(ddp) if all(r["final_val_loss"] <= ddp_best * (1 + NEAR_BEST) for r in ddp[lr])]
    stable = [lr for lr in sorted(ddp) if all(stable_run(r) for r in ddp[lr])]
    out = {"lrs": lrs, "ddp_best_lr": ddp_best_lr, "ddp_best_loss": ddp_best, "ddp_stable_lrs": stable,
           "ddp_near_best_lrs": near, "highest_stable_lr": max(stable) if stable else ddp_best_lr, "methods": {}}
    for method, by_lr in t.items():
        cells = {}
        for lr, rs in sorted(by_lr.items()):
            losses = [r["final_val_loss"] for r in rs]
            cell = {"n": len(rs), "mean": mean_loss(rs), "min": min(losses), "max": max(losses),
                    "std": statistics.stdev(losses) if len(rs) > 1 and all(finite(x) for x in losses) else 0.0}
            if lr in ddp:
                gaps = paired_gaps(rs, ddp[lr])
                seeds = {int(r["seed"]) for r in rs}  # against DDP's mean over the same seeds (DPU has one)
                base = mean_loss([r for r in ddp[lr] if int(r["seed"]) in seeds] or ddp[lr])
                cell["gap"] = (cell["mean"] - base) / base
                cell["gap_min"], cell["gap_max"] = (min(gaps), max(gaps)) if gaps else (math.nan, math.nan)
            cells[lr] = cell
        best_lr = min(cells, key=lambda lr: cells[lr]["mean"])
        within = [lr for lr in sorted(cells) if lr in ddp and method != "ddp" and cells[lr]["gap"] <= CLOSE]
        out["methods"][method] = {"cells": cells, "best_lr": best_lr, "best_loss": cells[best_lr]["mean"],
                                  "within_1pct_lrs": within,
                                  "gap_at_ddp_best": cells.get(ddp_best_lr, {}).get("gap", math.nan)}
    return out


def gap_over_time(a: List[dict], b: List[dict], window: int) -> List[float]:
    """Relative train-loss gap (a - b) / b per update, paired by seed, averaged over seeds, smoothed."""
    bs = {r["seed"]: r["train_loss"] for r in b}
    rows = [[(x - y) / y for x, y in zip(r["train_loss"], bs[r["seed"]])] for r in a if r["seed"] in bs]
    if not rows:
        return []
    mean = [statistics.fmean(col) for col in zip(*rows)]
    return [statistics.fmean(mean[max(0, i - window + 1): i + 1]) for i in range(len(mean))]


def phase_gaps(a: List[dict], b: List[dict], bounds: List[int]) -> List[float]:
    """Mean relative train-loss gap over the update ranges [bounds[i], bounds[i+1])."""
    g = gap_over_time(a, b, 1)
    return [statistics.fmean(g[lo:hi]) if g[lo:hi] else math.nan for lo, hi in zip(bounds, bounds[1:])]


def estimate_ratio(rs: List[dict], lo: int, hi: int) -> float:
    """Median over seeds and updates [lo, hi) of |theta~ - theta| / |theta_t+1 - theta_t|."""
    vals = [g / u for r in rs if r.get("estimate_gap") for g, u in zip(r["estimate_gap"][lo:hi], r["update_norm"][lo:hi])
            if finite(g) and finite(u) and u > 0]
    return statistics.median(vals) if vals else math.nan


def pct(x: float) -> str:
    return "n/a" if not finite(x) else f"{x:+.2%}"


def report_markdown(records: List[dict], s: dict, name: str = "lr-study", prefix: str = "convergence_lr") -> str:
    t = table_of(records)
    methods = [m for m in ["ddp", "acco", *sorted(set(t) - {"ddp", "acco", "dpu"}), "dpu"] if m in t]
    cfg = records[0]["config"]
    tokens = records[0]["tokens_per_update"]
    hours = sum(r["wall_s"] for r in records) / 3600
    begin, end = markers(name)
    lines = [begin, "",
             f"Records: {len(records)} runs, {hours:.2f} h of run time in all, "
             f"{cfg['n_layer']} layers x {cfg['n_embd']} wide, {cfg['max_iters']} updates of {tokens:,} tokens "
             f"(2 ranks x {cfg['gradient_accumulation_steps']} micro-batches x {cfg['batch_size']} x "
             f"{cfg['block_size']}), warm-up {cfg['warmup_iters']}, cosine to {cfg['min_lr_ratio']:g} x peak; "
             f"held-out loss on {cfg['eval_iters']} fixed batches.", "",
             "Final held-out loss, mean ± std over seeds [min–max] (n seeds); gap to DDP at the same LR, "
             "of the mean to DDP's mean over the same seeds, and [range of per-seed gaps]:", "",
             "| peak LR | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for lr in s["lrs"]:
        row = [f"{lr:g}"]
        for m in methods:
            c = s["methods"][m]["cells"].get(lr)
            if c is None:
                row.append("—")
                continue
            text = f"{c['mean']:.4f} ± {c['std']:.4f} [{c['min']:.4f}–{c['max']:.4f}] ({c['n']})"
            if m != "ddp" and "gap" in c:
                text += f"<br>{pct(c['gap'])} [{pct(c['gap_min'])}, {pct(c['gap_max'])}]"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| method | best LR | loss there | gap at DDP's best LR | LRs within 1% of DDP |", "|---|---|---|---|---|"]
    for m in methods:
        ms = s["methods"][m]
        within = "—" if m == "ddp" else ", ".join(f"{lr:g}" for lr in ms["within_1pct_lrs"]) or "none"
        gap = "—" if m == "ddp" else pct(ms["gap_at_ddp_best"])
        lines.append(f"| {m} | {ms['best_lr']:g} | {ms['best_loss']:.4f} | {gap} | {within} |")
    best, high = s["ddp_best_lr"], s["highest_stable_lr"]
    done = f"{len(records)} of the plan's runs are recorded; a method's best LR is among the LRs it has run."
    lines += ["", f"DDP's best LR: {best:g} (loss {s['ddp_best_loss']:.4f}). DDP is within {NEAR_BEST:.0%} of its best "
              f"at: {', '.join(f'{lr:g}' for lr in s['ddp_near_best_lrs'])}; stable (no held-out rise above "
              f"{STABLE_RISE:.0%} after update {STABLE_AFTER}, every seed) at: "
              f"{', '.join(f'{lr:g}' for lr in s['ddp_stable_lrs']) or 'none'}; highest stable: {high:g}. {done}", "",
              "Where the gap is made: mean relative train-loss gap to DDP (same seeds, same batches) over ranges "
              "of updates, and the median |θ̃ − θ| / |θ_{t+1} − θ_t| over the same ranges:", ""]
    n = cfg["max_iters"]
    bounds = sorted({0, min(10, n), min(50, n), min(150, n), n})
    head = " | ".join(f"updates {lo}–{hi - 1}" for lo, hi in zip(bounds, bounds[1:]))
    lines += [f"| method, LR | {head} |", "|---|" + "---|" * (len(bounds) - 1)]
    most = max(len(rs) for rs in t["ddp"].values())  # and every LR where DDP has its most seeds so far
    for lr in sorted({best, high} | {lr for lr, rs in t["ddp"].items() if len(rs) == most > 1}):
        for m in methods:
            if m == "ddp" or lr not in t[m] or lr not in t["ddp"]:
                continue
            gaps = phase_gaps(t[m][lr], t["ddp"][lr], bounds)
            ratios = [estimate_ratio(t[m][lr], lo, hi) for lo, hi in zip(bounds, bounds[1:])]
            cells = [pct(g) + ("" if not finite(q) else f"; {q:.2f}") for g, q in zip(gaps, ratios)]
            lines.append(f"| {m}, {lr:g} | " + " | ".join(cells) + " |")
    lines += ["", f"![final loss vs LR]({prefix}.png)", "", f"![curves and gap over time]({prefix}_curves.png)",
              "", end]
    return "\n".join(lines)


def write_doc(doc: Path, block: str, name: str = "lr-study") -> None:
    write_block(doc, block, *markers(name))


def write_block(doc: Path, block: str, begin: str, end: str) -> None:
    """Put ``block`` (which starts with ``begin`` and ends with ``end``) in place of the doc's block between those
    markers, or at the doc's end if it has none; the prose around it is kept."""
    text = doc.read_text() if doc.exists() else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def plot(records: List[dict], s: dict, out_dir: Path, prefix: str = "convergence_lr") -> List[Path]:
    import matplotlib  # noqa: PLC0415 (an example's extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    t = table_of(records)
    colors = {"ddp": "black", "acco": "tab:blue", "dpu": "tab:red", "sync": "tab:gray", "acco-sync20": "tab:green",
              "dpu-ef": "tab:purple"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, by_lr in t.items():
        lrs = sorted(by_lr)
        cells = s["methods"][m]["cells"]
        means = [min(cells[lr]["mean"], 1e3) for lr in lrs]
        lo = [means[i] - cells[lr]["min"] for i, lr in enumerate(lrs)]
        hi = [min(cells[lr]["max"], 1e3) - means[i] for i, lr in enumerate(lrs)]
        ax.errorbar(lrs, means, yerr=[lo, hi], marker="o", capsize=3, label=m, color=colors.get(m))
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final held-out loss (mean, min–max over seeds)")
    finite_best = [c["mean"] for ms in s["methods"].values() for c in ms["cells"].values() if finite(c["mean"])]
    # up to 1.9x the best mean: DPU's runs inside the axes, a diverged run's off them
    ax.set_ylim(min(finite_best) * 0.98, min(max(finite_best) * 1.02, min(finite_best) * 1.9))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    first = out_dir / f"{prefix}.png"
    fig.savefig(first, dpi=110)
    plt.close(fig)

    lrs = sorted({s["ddp_best_lr"], s["highest_stable_lr"]})
    fig, axes = plt.subplots(2, len(lrs), figsize=(6 * len(lrs), 7), squeeze=False)
    for j, lr in enumerate(lrs):
        for m, by_lr in t.items():
            if lr not in by_lr:
                continue
            rs = by_lr[lr]
            iters = [i for i, _ in rs[0]["val"]]
            mean = [statistics.fmean(r["val"][k][1] for r in rs) for k in range(len(iters))]
            axes[0][j].plot(iters, mean, marker=".", label=f"{m} ({len(rs)} seed{'s' if len(rs) > 1 else ''})", color=colors.get(m))
            if m != "ddp" and lr in t["ddp"]:
                axes[1][j].plot(gap_over_time(rs, t["ddp"][lr], 10), label=m, color=colors.get(m))
        axes[0][j].set_title(f"peak LR {lr:g}")
        axes[0][j].set_ylabel("held-out loss")
        axes[0][j].set_yscale("log")
        axes[0][j].legend()
        axes[1][j].axhline(0, color="black", lw=0.5)
        axes[1][j].set_ylabel("train-loss gap to DDP (10-update mean)")
        axes[1][j].set_xlabel("update")
        axes[1][j].set_ylim(-0.05, 0.25)
        if axes[1][j].get_legend_handles_labels()[0]:
            axes[1][j].legend()
    fig.tight_layout()
    second = out_dir / f"{prefix}_curves.png"
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [first, second]


def report(args: argparse.Namespace) -> dict:
    # Every record of this configuration whose method the tool knows, whatever --methods names: a run of a
    # subset (one method, one seed) must not drop the other columns from the page's block.
    config = config_of(args)
    records = [r for r in load_records(args.records) if r["config"] == config and r["method"] in METHODS]
    if not records:
        raise SystemExit(f"no records for this configuration in {args.records}: run the study first")
    s = summarize(records)
    name, prefix = ("muon-study", "convergence_muon_lr") if args.optimizer == "muon" else ("lr-study", "convergence_lr")
    write_doc(args.doc, report_markdown(records, s, name, prefix), name)
    if not args.no_plots:
        plot(records, s, args.doc.parent, prefix)
    print(f"report: {len(records)} records -> {args.doc}", flush=True)
    return s


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=Path, default=ROOT / "docs" / "convergence_data" / "lr_study.jsonl")
    p.add_argument("--doc", type=Path, default=None,
                   help="the page whose markers get the report (default: docs/studies/lr-study.md, "
                        "with --optimizer muon docs/studies/muon-study.md); the plots go beside it")
    p.add_argument("--methods", type=lambda s: s.split(","), default=["ddp", "acco", "acco-sync20", "dpu"])
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--dpu-seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    p.add_argument("--remedy-lrs", type=lambda s: [float(x) for x in s.split(",")], default=[2e-3, 4e-3],
                   help="the LRs the remedies (%s) run at" % ", ".join(REMEDIES))
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=16)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="muon: the Muon + AdamW split in both loops; --lrs are then Muon's, AdamW's is --adamw-lr")
    p.add_argument("--adamw-lr", type=float, default=2e-3, help="with --optimizer muon: the AdamW groups' peak LR")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.doc is None:
        args.doc = ROOT / "docs" / "studies" / ("muon-study.md" if args.optimizer == "muon" else "lr-study.md")
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown method(s) {sorted(unknown)}: choose from {sorted(METHODS)}")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if not args.report_only:
        run_missing(args)
    return report(args)


if __name__ == "__main__":
    main()
