"""Time to target (docs/studies/time-to-target.md): how many updates, and how much time, ACCO needs to reach DDP's model.

    python examples/nanogpt/time_to_target.py                 # run what is missing (resumable), then report
    python examples/nanogpt/time_to_target.py --report-only   # tables and plot from the records alone

The target is DDP's final held-out loss at DDP's best learning rate (``--lr``;
``--acco-lrs``: other LRs where every method runs too). Every loss
compared is the end of a fully decayed schedule, never the middle of one: a
run cut short in a cosine has not decayed yet, which flatters the method that
is behind. The schedule is warm-up, constant, then a linear cool-down over the
last ``--cooldown-frac`` of the run (WSD). One *trunk* per method, LR, warm-up
and seed trains at the constant rate and keeps checkpoints; each *branch*
resumes one of them at ``S = (1 - cooldown_frac) * T`` and cools down to ``T``.
So a method's fully decayed loss at several lengths ``T`` costs one trunk and a
short branch per length.

Updates to target: for each seed, the target is DDP's fully decayed loss at
``T_DDP`` (500 and 1500 updates). A method's branches are run at
``T_DDP * r`` for r in 1, then 13/12, 14/12 while the loss is still above the
target, or 11/12 if it is already below; the updates it needs are interpolated
linearly between the two branches that bracket the target. The ratio to
``T_DDP`` is the updates ratio. Time to target is that count times the
method's measured time per update (``benchmarks/`` on the netns testbed),
against DDP's.

Every run is a nanoGPT-style loop of this folder (``train_ddp.py``,
``train_acco.py``, unchanged) under torchrun on 2 CPU ranks; a resumed run
continues exactly where the uninterrupted one would (a batch is a pure function
of its update, and an ACCO checkpoint holds the estimate the model trains on:
``acco/checkpoint.py``). Records are appended to ``--records``, one line per
finished run; trunks keep their checkpoints under ``--workdir`` (a trunk whose
checkpoints are gone is run again when a branch needs it, on from the latest one a shorter trunk kept).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from study import EXACT, PAPER, ROOT, launch, load_records, machine, phase_gaps, write_block

# method -> (script, its settings, instrument.py's flags): DDP + AdamW, ACCO as the paper has it (its exact
# estimate, named: the library's default is "auto"), ACCO with the estimate's gradients in bf16 (the library's
# default for these fp32 runs; docs/usage.md: estimate_dtype). Every ACCO method names its estimate_extrapolation:
# the records before "auto" (1.2 for AdamW) became the default were made with 1.0, and a resumed study must go on
# computing what its records hold.
BF16 = "--acco-option=estimate_dtype=bfloat16"
METHODS: Dict[str, Tuple[str, List[str], List[str]]] = {
    "ddp": ("train_ddp.py", [], []),
    "acco": ("train_acco.py", [], EXACT),
    "acco-bf16": ("train_acco.py", [], [BF16, PAPER]),
    # ... and its estimate handed off after 3 of the 4 micro-batches (estimate_microbatches=3): the commit round
    # hides behind 3 micro-batches, the bf16 estimate (half the commit's bytes) behind 1
    "acco-bf16-h3": ("train_acco.py", [], [BF16, PAPER, "--acco-option=estimate_microbatches=3"]),
    # a candidate remedy screened at one seed (instrument.py; not a library option): the estimate's gradient
    # blended half and half with the momentum
    "acco-bf16-blend50": ("train_acco.py", [], [BF16, PAPER, "--estimate-blend=0.5"]),
    # the estimate's step extrapolated by 1.2 (estimate_extrapolation; the records before it became an option
    # computed it through instrument.py, the same arithmetic: tests/test_time_to_target.py): the library's
    # default for Adam and AdamW since 2026-11-29 (estimate_extrapolation="auto")
    "acco-bf16-extrap120": ("train_acco.py", [], [BF16, "--acco-option=estimate_extrapolation=1.2"]),
    # plain ZeRO-1 (mode sync: reduce-scatter, step, all-gather, nothing overlapped): what an update of a
    # synchronous prefix costs on the testbed (benchmarks/time_to_target.py speed; docs/benchmarks.md §9d,
    # the record in docs/studies/benchmarks-time-per-update.md)
    "sync": ("train_acco.py", ["--mode=sync"], []),
    # mode dpu (the one-step-stale gradient, no estimate round), and with its error feedback (delay_correction=1.0,
    # the setting of Zmushko et al. 2026)
    "dpu": ("train_acco.py", ["--mode=dpu"], []),
    "dpu-ef": ("train_acco.py", ["--mode=dpu"], ["--acco-option=delay_correction=1.0"]),
    # compressed rounds (docs/compression.md): int8 blocks of 256 with error feedback, both directions, over the
    # library's default estimate (estimate_extrapolation "auto" is 1.2 for AdamW); and its peer, DDP with torch's
    # PowerSGD hook (rank 4, error feedback, warm start: instrument.py --ddp-hook=powersgd)
    "acco-int8": ("train_acco.py", [], ["--acco-option=compression=int8",
                                         "--acco-option=estimate_extrapolation=1.2"]),
    "ddp-powersgd": ("train_ddp.py", [], ["--ddp-hook=powersgd"]),
    # DDP with torch's fp16_compress_hook (the gradients all-reduced in fp16, no error feedback): the peer that
    # sends as many bytes per update as ACCO + int8 (docs/compression.md)
    "ddp-fp16": ("train_ddp.py", [], ["--ddp-hook=fp16"]),
}
# The branch lengths searched, as multiples of DDP's length, from 1 up (or down to 11/12) until two bracket DDP's
# loss. A trunk first runs to the start of the longest of TRUNK_RATIOS' branches; the longer lengths, for a method
# far from DDP (warm-up 20: more than 14/12 on two seeds of three), extend it from its latest checkpoint if asked.
# With --cap-first, a method expected beyond the longest length runs that one right after DDP's own (its trunk runs
# to that start at once): a cap that misses DDP's loss too ends the search there, with the bound the full walk
# would give under the walk's own assumption (loss falls with length); a cap that reaches it leaves the walk as is.
RATIOS = (11 / 12, 1.0, 13 / 12, 14 / 12, 16 / 12, 18 / 12)
TRUNK_RATIOS = RATIOS[:4]
GOAL_TIME = 0.75  # issue #28's goal: DDP's target in at most 0.75x DDP's wall-clock (and 1.03x its updates)
BEGIN, END = "<!-- time-to-target:begin (written by examples/nanogpt/time_to_target.py) -->", "<!-- time-to-target:end -->"


# ----------------------------------------------------------------------------- the plan


def config_of(args: argparse.Namespace) -> dict:
    """What makes two runs comparable (besides method, LR, seed, warm-up, length and floor): in every record."""
    return {
        "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "block_size": args.block_size,
        "batch_size": args.batch_size, "gradient_accumulation_steps": args.accum, "eval_interval": args.eval_interval,
        "eval_iters": args.eval_iters, "world_size": 2, "schedule": "wsd", "cooldown_frac": args.cooldown_frac,
        **({"optimizer": "muon", "adamw_lr": args.adamw_lr} if args.optimizer == "muon" else {}),
    }


def base_lr(args: argparse.Namespace, line: dict) -> float:
    """The schedule's peak (the loops' ``learning_rate``): the line's LR, or with Muon the AdamW groups' (the
    line's LR is then Muon's, scaled by the same schedule: examples/nanogpt/optim.py's ``lr_scale``)."""
    return args.adamw_lr if args.optimizer == "muon" else line["lr"]


def lines(args: argparse.Namespace) -> List[dict]:
    """The (method, lr, warm-up, seed) lines of the study, most important first.

    At the main warm-up (the first of ``--warmups``), seed by seed: DDP then every ACCO method at ``--lr``; then
    DDP at ``--ddp-lrs``, seed by seed; then DDP and every ACCO method at ``--acco-lrs``. Then the other
    warm-ups: DDP and the first ACCO method, at ``--lr`` and at ``--acco-lrs`` (a warm-up can move DDP's best
    LR: at warm-up 20, 2e-3 by the mean of 3 seeds, where 4e-3 is best at warm-up 100). A line's
    ``branches`` are the (T, floor) it always runs (DDP: every length at floor 0, and the other floors at the
    main warm-up's longest length or the other warm-ups' shortest); an ACCO line instead searches its
    updates-to-target (``search``) for each of DDP's (T, floor) at its LR."""
    main_w, longest, shortest = args.warmups[0], max(args.lengths), min(args.lengths)
    out = []
    for w in args.warmups:
        floors_at = longest if w == main_w else shortest
        fixed = [(t, 0.0) for t in args.lengths] + [(floors_at, f) for f in args.floors if f]
        for seed in args.seeds:
            for m in (args.methods if w == main_w else args.methods[:2]):
                others = ((args.ddp_lrs if m == "ddp" else []) + args.acco_lrs) if w == main_w else args.acco_lrs
                for lr in dict.fromkeys([args.lr] + others):  # each LR once, the main one first
                    out.append({"method": m, "lr": lr, "warmup": w, "seed": seed,
                                "branches": fixed if m == "ddp" else [], "search": [] if m == "ddp" else fixed,
                                "rank": (w != main_w, lr != args.lr, lr in args.acco_lrs, seed)})
    return sorted(out, key=lambda x: x["rank"])


def trunk_length(args: argparse.Namespace, line: dict) -> int:
    """A trunk runs to the start of the last branch its line may need (with --cap-first, the longest length's)."""
    if line["branches"]:
        return max(start_of(t, args.cooldown_frac) for t, _ in line["branches"])
    return max(start_of(length_of(t, r), args.cooldown_frac) for t, _ in line["search"]
               for r in (RATIOS if args.cap_first else TRUNK_RATIOS))


def length_of(t_ddp: int, ratio: float) -> int:
    return int(round(t_ddp * ratio))


def start_of(t: int, cooldown_frac: float) -> int:
    return int(round(t * (1 - cooldown_frac)))


def trunk_keeps(args: argparse.Namespace) -> List[int]:
    """The iterations whose checkpoints a trunk keeps: the start of every branch any line may need."""
    return sorted({start_of(length_of(t, r), args.cooldown_frac) for t in args.lengths for r in RATIOS})


def line_key(r: dict) -> tuple:
    return (r["method"], float(r["lr"]), int(r["warmup"]), int(r["seed"]), json.dumps(r["config"], sort_keys=True))


def branch_key(r: dict) -> tuple:
    return line_key(r) + (int(r["T"]), float(r["floor"]))


def trunk_dir(args: argparse.Namespace, line: dict) -> Path:
    muon = "-muon" if args.optimizer == "muon" else ""
    return args.workdir / f"{line['method']}-lr{line['lr']:g}-w{line['warmup']}-s{line['seed']}{muon}"


# ----------------------------------------------------------------------------- what the records say


def branches_of(records: List[dict], line: dict, config: dict) -> Dict[Tuple[int, float], float]:
    """(T, floor) -> final held-out loss of the line's branches."""
    k = line_key({**line, "config": config})
    return {(int(r["T"]), float(r["floor"])): r["final_val_loss"] for r in records
            if r["kind"] == "branch" and line_key(r) == k}


def target_of(records: List[dict], line: dict, config: dict, t_ddp: int, floor: float) -> Optional[float]:
    """DDP's fully decayed loss at ``t_ddp`` for the line's seed, LR and warm-up (None until it is run)."""
    ddp = {**line, "method": "ddp"}
    return branches_of(records, ddp, config).get((t_ddp, floor))


def search_state(losses: Dict[Tuple[int, float], float], target: float, t_ddp: int,
                 floor: float, cap_first: bool = False) -> Tuple[Optional[int], Optional[dict]]:
    """The next branch length the search needs (or None), and its result: when the search is done,
    ``{"updates": T*, "ratio": T*/T_DDP, "bracket": [..]}`` where ``T*`` is interpolated between the two branches
    that bracket the target; ``"updates"`` is None (and ``"bound"`` says which side) if no run brackets it. While
    it goes on (a session can stop inside one), the bound the lengths run so far give, marked ``"searching"``;
    None before the branch at DDP's length. ``cap_first``: above the target at DDP's length, ask for the longest
    length next; a longest length above the target, with no length run between it and DDP's below, ends the
    search whichever order ran it (another ``T``'s branch can be this one's longest length)."""
    seen = {r: losses.get((length_of(t_ddp, r), floor)) for r in RATIOS}
    one, cap = seen[1.0], seen[RATIOS[-1]]
    if one is None:
        return length_of(t_ddp, 1.0), None
    between = [seen[r] for r in RATIOS if 1.0 < r < RATIOS[-1] and seen[r] is not None]
    if one > target and cap is not None and cap > target and all(x > target for x in between):
        return None, beyond(">", RATIOS[-1])  # no length run brackets it: the walk's own end, reached sooner
    if one > target and cap is None and cap_first:
        return length_of(t_ddp, RATIOS[-1]), beyond(">", 1.0, searching=True)
    order = [r for r in RATIOS if r >= 1.0] if one > target else [1.0, RATIOS[0]]
    for a, b in zip(order, order[1:]):
        la, lb = seen[a], seen[b]
        if lb is None:
            if (la > target) == (one > target):
                return length_of(t_ddp, b), beyond(">" if one > target else "<", a, searching=True)
            break
        hi, lo = (a, b) if la > lb else (b, a)
        if seen[hi] > target >= seen[lo]:
            ta, tb = length_of(t_ddp, hi), length_of(t_ddp, lo)
            t_star = ta + (tb - ta) * (seen[hi] - target) / (seen[hi] - seen[lo])
            return None, {"updates": t_star, "ratio": t_star / t_ddp, "bracket": [ta, tb]}
    return None, beyond(">", RATIOS[-1]) if one > target else beyond("<", RATIOS[0])


def beyond(side: str, at: float, searching: bool = False) -> dict:
    """A search's result where no run brackets the target: the target lies on ``side`` of the length ``at`` (as a
    multiple of DDP's); ``searching``: the search goes on past it."""
    return {"updates": None, "ratio": None, "bound": f"{side} {at:.3f}", "at": at, **({"searching": True} if searching else {})}


def next_job(args: argparse.Namespace, records: List[dict]) -> Optional[dict]:
    """The first job of the plan that the records lack: a trunk, a fixed branch, or the next branch of a search."""
    config = config_of(args)
    for line in lines(args):
        trunk = {**line, "config": config}
        has_trunk = any(r["kind"] == "trunk" and line_key(r) == line_key(trunk) for r in records)
        losses = branches_of(records, line, config)
        wanted = [b for b in line["branches"] if b not in losses]
        for t_ddp, floor in line["search"]:
            target = target_of(records, line, config, t_ddp, floor)
            if target is None:
                continue  # DDP's line (earlier in the plan, or not in it) has not run this branch yet
            t, _ = search_state(losses, target, t_ddp, floor, args.cap_first)
            if t is not None:
                wanted.append((t, floor))
        if not has_trunk:
            return {"kind": "trunk", "line": line}
        if wanted:
            t, floor = wanted[0]
            return {"kind": "branch", "line": line, "T": t, "floor": floor}
    return None


# ----------------------------------------------------------------------------- running


def overrides_of(args: argparse.Namespace, line: dict) -> List[str]:
    muon = ["--optimizer_name=muon", f"--muon_lr={line['lr']}"] if args.optimizer == "muon" else []
    return [f"--seed={line['seed']}", f"--learning_rate={base_lr(args, line)}", *muon, f"--warmup_iters={line['warmup']}",
            f"--n_layer={args.n_layer}", f"--n_head={args.n_head}", f"--n_embd={args.n_embd}",
            f"--block_size={args.block_size}", f"--batch_size={args.batch_size}",
            f"--gradient_accumulation_steps={args.accum}", f"--eval_interval={args.eval_interval}",
            f"--eval_iters={args.eval_iters}", "--schedule=wsd", *METHODS[line["method"]][1]]


def record_of(args: argparse.Namespace, job: dict, evals: list, train: list, wall: float) -> dict:
    line = job["line"]
    return {
        "kind": job["kind"], "method": line["method"], "lr": line["lr"], "warmup": line["warmup"],
        "seed": line["seed"], "config": config_of(args), "T": job["T"], "floor": job.get("floor"),
        "start": job.get("start", 0), "final_val_loss": evals[-1]["val_loss"],
        "val": [[e["iter"], e["val_loss"]] for e in evals],
        "train_loss": [t["train_loss"] for t in train], "train_s": train[-1]["time"] if train else 0.0,
        "wall_s": round(wall, 1),
        "tokens_per_update": args.batch_size * args.block_size * args.accum * 2, **machine(),
    }


def run_trunk(args: argparse.Namespace, line: dict, length: Optional[int] = None) -> dict:
    """Run the line's trunk to ``length`` (by default ``trunk_length``): from scratch, or on from the latest checkpoint an earlier, shorter
    trunk of the same line kept (``extendable``). The record covers the whole trunk either way; its ``wall_s`` is
    this run's only (the earlier run has its own record), and ``extends`` says where this run resumed."""
    out = trunk_dir(args, line)
    script, _, flags = METHODS[line["method"]]
    keeps = ",".join(str(i) for i in trunk_keeps(args))
    length = length or trunk_length(args, line)
    overrides = overrides_of(args, line) + [
        f"--max_iters={length}", "--cooldown_iters=0", f"--min_lr={base_lr(args, line)}", f"--keep_ckpts={keeps}"]
    earlier = extendable(args, line, length)
    if earlier is None:
        shutil.rmtree(out, ignore_errors=True)
        evals, train, _, wall = launch(script, flags, overrides, out)
        return record_of(args, {"kind": "trunk", "line": line, "T": length}, evals, train, wall)
    at, before = earlier
    print(f"  trunk extended from its update {at} to {length}", flush=True)
    evals, train, _, wall = launch(script, flags, overrides + [
        "--init_from=resume", f"--resume_from={(out / f'ckpt-{at}.pt').resolve()}"], out)
    record = record_of(args, {"kind": "trunk", "line": line, "T": length},  # the length run, not the default's
                       [{"iter": i, "val_loss": v} for i, v in before["val"] if i <= at]
                       + [e for e in evals if e["iter"] > at], train, wall)
    record["train_loss"] = before["train_loss"][:at] + record["train_loss"]
    record["train_s"] = before["train_s"] * at / len(before["train_loss"]) + record["train_s"]
    record["extends"] = at
    return record


def extendable(args: argparse.Namespace, line: dict, length: int) -> Optional[Tuple[int, dict]]:
    """``(K, record)``: the latest checkpoint ``ckpt-K.pt`` (K < ``length``) in the line's trunk folder that a
    recorded trunk of the line (same settings, at least K updates long) accounts for, or None. The trunk's LR is
    constant after the warm-up and a batch is a pure function of its update, so going on from K computes the
    same updates as a trunk run from scratch (at the smoke's tiny size, 10 updates then 4 more matched 14 from
    scratch bit for bit, DDP and ACCO with the bf16 estimate alike)."""
    key = line_key({**line, "config": config_of(args)})
    recorded = [r for r in load_records(args.records) if r["kind"] == "trunk" and line_key(r) == key]
    kept = sorted((int(f.stem.split("-")[1]) for f in trunk_dir(args, line).glob("ckpt-*.pt")
                   if f.stem.split("-")[1].isdigit()), reverse=True)
    for at in kept:
        before = [r for r in recorded if len(r["train_loss"]) >= at]
        if 0 < at < length and before:
            return at, before[-1]
    return None


def run_branch(args: argparse.Namespace, job: dict, tmp: Path) -> dict:
    line, t, floor = job["line"], job["T"], job["floor"]
    start = start_of(t, args.cooldown_frac)
    ckpt = trunk_dir(args, line) / f"ckpt-{start}.pt"
    if not ckpt.exists():  # the records have the trunk, this machine not its checkpoints (or a longer search
        # asks for more of it than a trunk's first run does): run it again, or on, to at least this branch's start
        print(f"  trunk checkpoint {ckpt} missing: running the trunk to update {start}", flush=True)
        append_record(args, run_trunk(args, line, max(trunk_length(args, line), start)))  # a finished run too
    script, _, flags = METHODS[line["method"]]
    out = tmp / f"branch-{t}"
    evals, train, _, wall = launch(script, flags, overrides_of(args, line) + [
        f"--max_iters={t}", f"--cooldown_iters={t - start}", f"--min_lr={base_lr(args, line) * floor}",
        "--init_from=resume", f"--resume_from={ckpt.resolve()}"], out)
    return record_of(args, {**job, "start": start}, evals, train, wall)


def append_record(args: argparse.Namespace, record: dict) -> None:
    """One line per finished run: the study resumes from here (a line key's last trunk is the one the report reads)."""
    with open(args.records, "a") as f:
        f.write(json.dumps(record) + "\n")


def run_missing(args: argparse.Namespace) -> None:
    args.records.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ttt-") as tmp:
        while True:
            job = next_job(args, load_records(args.records))
            if job is None:
                break
            line = job["line"]
            what = (f"{job['kind']} {line['method']} lr={line['lr']:g} warm-up {line['warmup']} seed {line['seed']}"
                    + (f" T={job['T']} floor {job['floor']:g}" if job["kind"] == "branch" else ""))
            print(f"time to target: {what} ...", flush=True)
            for attempt in (1, 2):  # once more: a shared machine can kill a run (the study is hours long)
                try:
                    record = run_trunk(args, line) if job["kind"] == "trunk" else run_branch(args, job, Path(tmp))
                    break
                except RuntimeError as exc:
                    if attempt == 2:
                        raise
                    print(f"{exc}\nretrying once", file=sys.stderr, flush=True)
            append_record(args, record)
            print(f"  final held-out loss {record['final_val_loss']:.4f} ({record['wall_s']:.0f} s)", flush=True)


# ----------------------------------------------------------------------------- the report (records only)


LABELS = {"ddp": "DDP + AdamW", "acco": "ACCO", "acco-bf16": "ACCO, bf16 estimate",
          "acco-bf16-h3": "ACCO, bf16 estimate after 3 of 4",
          "acco-bf16-blend50": "ACCO, bf16 estimate blended with the momentum (w = 0.5, study only)",
          "acco-bf16-extrap120": "ACCO, bf16 estimate, estimate_extrapolation=1.2",
          "sync": "ZeRO-1 (mode sync)", "dpu": "DPU (mode dpu, a one-step-stale gradient)",
          "dpu-ef": "DPU with error feedback (delay_correction=1.0)",
          "acco-int8": "ACCO, int8 rounds with error feedback (compression=\"int8\")",
          "ddp-powersgd": "DDP + torch's PowerSGD hook (rank 4, error feedback)",
          "ddp-fp16": "DDP + torch's fp16_compress_hook"}


def label(method: str, args: argparse.Namespace) -> str:
    """A method's name in the report; DDP's names its optimizer (with Muon, the Muon + AdamW split)."""
    if method == "ddp" and args.optimizer == "muon":
        return "DDP + Muon (the Muon + AdamW split)"
    return LABELS.get(method, method)


def bounded(result: dict) -> Tuple[float, str]:
    """A search result as (value, side): the interpolated ratio and ``""``, or for a target beyond the lengths
    searched the nearest length's ratio and ``"<"``/``">"`` (the true ratio lies beyond it)."""
    if result["ratio"] is not None:
        return result["ratio"], ""
    return result["at"], result["bound"][0]


def bounded_text(result: dict, scale: float = 1.0) -> str:
    """``bounded`` written out, its value times ``scale``: ``"1.054"``, or ``"< 0.917"`` beyond the lengths, then
    ``"(searching)"`` if the search is not done."""
    value, side = bounded(result)
    return " ".join(filter(None, [side, f"{value * scale:.3f}", "(searching)" if result.get("searching") else ""]))


def mean_bounded(results: List[dict]) -> Optional[Tuple[float, str]]:
    """The mean over seeds of ``bounded`` ratios, and its side: ``""`` if every seed is exact, ``"<"``/``">"`` if
    some are bounds on one side (the bound's value stands in for them: the mean is then a bound too). None if
    there are none, or bounds on both sides."""
    pairs = [bounded(r) for r in results]
    sides = {side for _, side in pairs if side}
    if not pairs or len(sides) > 1:
        return None
    return statistics.fmean(v for v, _ in pairs), (next(iter(sides)) if sides else "")


def mean_cell(results: List[dict], fmt: Callable[[float], str] = "{:.3f}".format) -> str:
    """``mean_bounded`` written out: ``≤``/``≥`` before a bound, ``—`` if there is no mean."""
    m = mean_bounded(results)
    return "—" if m is None else {"<": "≤ ", ">": "≥ ", "": ""}[m[1]] + fmt(m[0])


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def speeds(paths: List[Path]) -> Dict[str, List[dict]]:
    """Time per update of each method on the testbed, relative to DDP's, from ``benchmarks/time_to_target.py
    speed`` records (the study's loops, one link per file): per repeat, DDP's tokens/s over the method's in the
    same file (the same tokens per update), then the median and range over repeats. A method measured in
    several files has one entry per file, in the files' order: each file is its own link and machine, so the
    composed table shows each, never one file's method against another file's. Files that are absent are
    skipped."""
    out: Dict[str, List[dict]] = {}
    for path in paths:
        if not path.exists():
            continue
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        by: Dict[tuple, float] = {(r["method"], r.get("repeat", 0)): r["tokens_per_s"] for r in recs}
        for method in METHODS:
            ratios = [by[("ddp", rep)] / by[(m, rep)] for (m, rep) in by if m == method and ("ddp", rep) in by]
            if ratios:
                out.setdefault(method, []).append(
                    {"time_per_update": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                     "repeats": len(ratios), "rate_mbit": recs[0].get("rate_mbit"), "file": path.name})
    return out


def gap_ranges(warmup: int, length: int) -> List[Tuple[int, int]]:
    """Update ranges ``[lo, hi)`` where the trunks' gap is read, up to update ``length``: the two halves of the
    warm-up (none below 2 updates), then ranges that double (``[w, 2w)``, ``[2w, 4w)``, ...), the last one cut
    at ``length``."""
    w = max(1, warmup)
    out = [(0, w // 2), (w // 2, w)] if warmup >= 2 else [(0, w)]
    lo = w
    while lo < length:
        out.append((lo, min(2 * lo, length)))
        lo *= 2
    return [(lo, hi) for lo, hi in out if lo < hi <= length]


def trunk_gaps(records: List[dict], args: argparse.Namespace) -> dict:
    """Where the gap is made, from the trunks (constant peak LR after the warm-up) at the main LR and warm-up:
    ``{"ranges": [(lo, hi), ...], "train": {method: [[gap per seed] per range]}, "val": {method: [[...]]}}``.
    ``train``: each seed's mean per-update train-loss gap over the range against DDP's trunk of the same seed
    (``study.phase_gaps``, as the learning-rate study's table reads it); ``val``: the held-out gap at the
    range's last evaluation ``hi`` (when both trunks evaluated there). Ranges reach the longest pair of trunks
    of one seed; a seed whose pair is shorter leaves them out."""
    w = args.warmups[0]
    trunks = {(r["method"], int(r["seed"])): r for r in records
              if r["kind"] == "trunk" and float(r["lr"]) == args.lr and int(r["warmup"]) == w}
    pairs = [(m, seed) for m, seed in sorted(trunks) if m != "ddp" and ("ddp", seed) in trunks]
    if not pairs:
        return {}
    length = max(min(len(trunks["ddp", s]["train_loss"]), len(trunks[m, s]["train_loss"])) for m, s in pairs)
    ranges = gap_ranges(w, length)
    out: dict = {"ranges": ranges, "train": {}, "val": {}}
    for m, seed in pairs:
        d, o = trunks["ddp", seed], trunks[m, seed]
        dv, ov = dict(map(tuple, d["val"])), dict(map(tuple, o["val"]))
        train = out["train"].setdefault(m, [[] for _ in ranges])
        val = out["val"].setdefault(m, [[] for _ in ranges])
        n = min(len(d["train_loss"]), len(o["train_loss"]))
        gaps = phase_gaps([o], [d], [lo for lo, _ in ranges] + [ranges[-1][1]])
        for i, (lo, hi) in enumerate(ranges):
            if hi <= n:  # a range the pair covers whole
                train[i].append(gaps[i])
            if hi in dv and hi in ov:
                val[i].append((ov[hi] - dv[hi]) / dv[hi])
    return out


def summarize(records: List[dict], args: argparse.Namespace) -> dict:
    """Every number of the report, from the records: per line and target, each seed's updates to target."""
    config = config_of(args)
    records = [r for r in records if r["config"] == config]
    rows = []
    for line in lines(args):
        if line["method"] == "ddp":
            continue
        for t_ddp, floor in line["search"]:
            target = target_of(records, line, config, t_ddp, floor)
            if target is None:
                continue
            losses = branches_of(records, line, config)
            _, result = search_state(losses, target, t_ddp, floor)
            rows.append({"method": line["method"], "lr": line["lr"], "warmup": line["warmup"], "seed": line["seed"],
                         "T": t_ddp, "floor": floor, "target": target, "loss_at_T": losses.get((t_ddp, floor)),
                         "result": result})
    ddp = [{"lr": float(r["lr"]), "warmup": int(r["warmup"]), "seed": int(r["seed"]), "T": int(r["T"]),
            "floor": float(r["floor"]), "loss": r["final_val_loss"]}
           for r in records if r["kind"] == "branch" and r["method"] == "ddp"]
    return {"rows": rows, "ddp": ddp, "records": len(records), "trunk_gaps": trunk_gaps(records, args),
            "hours": sum(r["wall_s"] for r in records) / 3600}


def ddp_best_lrs(ddp: List[dict]) -> Dict[tuple, Tuple[float, List[float]]]:
    """``{(warm-up, T, floor): (DDP's best LR, the LRs run)}``: the LR of the lowest mean loss over the seeds that
    every LR run there shares (all of its seeds where there is one LR)."""
    out = {}
    for key in {(d["warmup"], d["T"], d["floor"]) for d in ddp}:
        by = {}
        for d in ddp:
            if (d["warmup"], d["T"], d["floor"]) == key:
                by.setdefault(d["lr"], {})[d["seed"]] = d["loss"]
        shared = set.intersection(*(set(v) for v in by.values()))
        if shared:
            lr = min(by, key=lambda x: statistics.fmean(by[x][seed] for seed in shared))
            out[key] = (lr, sorted(by))
    return out


def lr_cell(lr: float, best: Optional[Tuple[float, List[float]]]) -> str:
    """A row's LR, and DDP's best where DDP did better at another LR of that schedule: the row's target is then
    not the best DDP reached."""
    return f"{lr:g}" if best is None or best[0] == lr else f"{lr:g} (DDP's best: {best[0]:g})"


def report_markdown(s: dict, args: argparse.Namespace, speed: Dict[str, List[dict]]) -> str:
    cfg = config_of(args)
    all_lrs = list(dict.fromkeys([args.lr] + args.ddp_lrs + args.acco_lrs))
    tokens = args.batch_size * args.block_size * args.accum * 2
    out = [BEGIN, "",
           f"Records: {s['records']} runs (trunks and cool-down branches), {s['hours']:.2f} h of run time, "
           f"{cfg['n_layer']} layers x {cfg['n_embd']} wide, {tokens:,} tokens per update, peak LR "
           f"{', '.join(f'{lr:g}' for lr in all_lrs)}"
           + (f" (Muon's; the AdamW groups' peak {args.adamw_lr:g})" if args.optimizer == "muon" else "") + "; "
           f"warm-up, constant, then linear cool-down over the last {cfg['cooldown_frac']:.0%} of a run of T updates "
           "to the floor x peak; held-out loss on "
           f"{cfg['eval_iters']} fixed batches at the end of the cool-down.", ""]
    # DDP's own losses, the targets, at each schedule and LR
    out += [f"{label('ddp', args)}, fully decayed held-out loss (mean over seeds [min–max], n):", "",
            "| warm-up | T | floor | " + " | ".join(f"LR {lr:g}" for lr in all_lrs) + " |",
            "|---|---|---|" + "---|" * len(all_lrs)]
    keys = sorted({(d["warmup"], d["T"], d["floor"]) for d in s["ddp"]}, key=lambda k: (k[0] != args.warmups[0], k))
    for w, t, f in keys:
        cells = []
        for lr in all_lrs:
            xs = [d["loss"] for d in s["ddp"] if (d["warmup"], d["T"], d["floor"], d["lr"]) == (w, t, f, lr)]
            cells.append(f"{statistics.fmean(xs):.4f} [{min(xs):.4f}–{max(xs):.4f}] ({len(xs)})" if xs else "—")
        out.append(f"| {w} | {t} | {f:g} | " + " | ".join(cells) + " |")
    best = ddp_best_lrs(s["ddp"])
    if any(len(lrs) > 1 for _, lrs in best.values()):
        out += ["", "DDP's best LR (the lowest mean over the seeds both LRs share), where more than one was run: "
                + "; ".join(f"warm-up {w}, T {t}, floor {f:g}: {lr:g} (of {', '.join(f'{x:g}' for x in lrs)})"
                            for (w, t, f), (lr, lrs) in sorted(best.items()) if len(lrs) > 1) + "."]
    # updates to target
    out += ["", "Updates to DDP's fully decayed loss (same seed, same LR, same schedule), as a multiple of DDP's "
            "T: per seed, and the mean; `>`/`<`: beyond the lengths searched (the mean then takes the last length searched for that seed, and is a bound: `≤`/`≥`); `(searching)`: the lengths run so far, "
            "where a session stopped inside a search (the study goes on from there). Loss gap: the method's loss at "
            "DDP's T against DDP's.", "",
            "| method | LR | warm-up | T | floor | per seed (updates ratio) | mean ratio | mean extra updates "
            "| loss gap at T |",
            "|---|---|---|---|---|---|---|---|---|"]
    groups: Dict[tuple, List[dict]] = {}
    for r in s["rows"]:
        groups.setdefault((r["method"], float(r["lr"]), r["warmup"], r["T"], r["floor"]), []).append(r)

    def order(kv):  # the main warm-up, then the main LR, first
        m, lr, w, t, f = kv[0]
        return (w != args.warmups[0], lr != args.lr, lr, t, f, m)

    for (m, lr, w, t, f), rs in sorted(groups.items(), key=order):
        rs = sorted(rs, key=lambda r: r["seed"])
        done = [r for r in rs if r["result"] is not None]
        per = ", ".join(f"s{r['seed']} {bounded_text(r['result'])}" for r in done) or "—"
        extra = mean_cell([r["result"] for r in done], fmt=lambda x: f"{x * t - t:+.0f}")
        gaps = [(r["loss_at_T"] - r["target"]) / r["target"] for r in rs if r["loss_at_T"] is not None]
        mean = mean_cell([r["result"] for r in done])
        mean = mean if mean == "—" else f"{mean} ({len(done)} seed{'s' if len(done) != 1 else ''})"
        out.append(f"| {label(m, args)} | {lr_cell(lr, best.get((w, t, f)))} | {w} | {t} | {f:g} | {per} | {mean} | {extra} | "
                   f"{f'{statistics.fmean(gaps):+.2%}' if gaps else '—'} |")
    # where the gap is made: the trunks, at the constant peak LR
    tg = s.get("trunk_gaps")
    if tg:
        ranges = tg["ranges"]

        def cell(c: List[float]) -> str:
            return f"{statistics.fmean(c):+.2%} [{min(c):+.2%}–{max(c):+.2%}] ({len(c)})" if c else "—"

        out += ["", f"Where the gap is made: the trunks (warm-up {args.warmups[0]}, then the constant peak LR "
                f"{args.lr:g}) against "
                "DDP's trunk of the same seed. Train: the mean over the range of each update's relative train-loss gap "
                "(each update's loss on its own batch; ACCO's first half taken at θ̃), as in the learning-rate study; held-out: the gap of the evaluation after the "
                "range's last update. Mean over seeds [min–max] (n):", "",
                "| method | " + " | ".join(f"updates {lo}–{hi - 1}" for lo, hi in ranges) + " |",
                "|---|" + "---|" * len(ranges)]
        for m in tg["train"]:
            out.append(f"| {label(m, args)}, train | " + " | ".join(cell(c) for c in tg["train"][m]) + " |")
            out.append(f"| {label(m, args)}, held-out at the end | "
                       + " | ".join(cell(c) for c in tg["val"][m]) + " |")
    # time to target, composed
    if speed:
        out += ["", "Time to target, composed: the updates ratio times the method's time per update over DDP's on "
                "the netns testbed (the link where a round lasts about half an update's compute on the machine that "
                "measured it; `docs/benchmarks.md` §9), median [range] over interleaved repeats, each method "
                "against DDP in the same benchmark run (its link and repeats in the column; a method measured in "
                "several runs has a row for each, and rows compare only at the same link; a setting has rows once a "
                "seed has its updates ratio):", "",
                f"The last two columns are what a time to target of {GOAL_TIME:g}x DDP's would ask: of the time per "
                "update, at the mean updates ratio measured; of the updates ratio, at the median time per update "
                "measured (below 1: fewer updates than DDP itself).", "",
                "| method | LR | warm-up | T | floor | time per update vs DDP | time to target vs DDP, per seed | mean "
                f"| {GOAL_TIME:g}x asks: time per update | {GOAL_TIME:g}x asks: updates ratio |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for (m, lr, w, t, f), rs in sorted(groups.items(), key=order):
            done = [r for r in sorted(rs, key=lambda r: r["seed"]) if r["result"] is not None]
            if w != args.warmups[0] or not done:  # no seed has an updates ratio to compose
                continue
            # a mean that is a bound (a seed beyond the lengths searched) bounds what it asks the other way round
            asks = mean_cell([r["result"] for r in done], fmt=lambda x: f"{GOAL_TIME / x:.3f}")
            asks = asks.replace("≤", "≥", 1) if asks.startswith("≤") else asks.replace("≥", "≤", 1)
            for sp in speed.get(m, []):  # a row per benchmark run: a run's method only against its own DDP
                cells = ", ".join(f"s{r['seed']} {bounded_text(r['result'], sp['time_per_update'])}" for r in done)
                mean = mean_cell([r["result"] for r in done], fmt=lambda x: f"{x * sp['time_per_update']:.3f}")
                where = f", `{sp['file']}`" if sp.get("file") else ""  # two runs at one link differ by their file
                out.append(f"| {label(m, args)} | {lr_cell(lr, best.get((w, t, f)))} | {w} | {t} | {f:g} "
                           f"| {sp['time_per_update']:.3f} [{sp['min']:.3f}–{sp['max']:.3f}] "
                           f"({sp['rate_mbit']:g} Mbit/s, {sp['repeats']} repeats{where}) | {cells} | {mean} "
                           f"| {asks} | {GOAL_TIME / sp['time_per_update']:.3f} |")
    out += ["", f"![loss against run length]({plot_name(args)})", "", END]
    return "\n".join(out)


def plot(records: List[dict], args: argparse.Namespace, path: Path) -> None:
    """Fully decayed held-out loss against T (each branch's end), per method, at the main LR and warm-up and floor 0,
    mean over seeds; and the trunks' held-out curves (constant LR) of seed 0."""
    import matplotlib  # noqa: PLC0415 (an example's extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    config = config_of(args)
    rs = [r for r in records if r["config"] == config and r["warmup"] == args.warmups[0] and float(r["lr"]) == args.lr]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    colors = {"ddp": "black", "acco": "tab:blue", "acco-bf16": "tab:orange", "acco-bf16-h3": "tab:green",
              "acco-bf16-blend50": "tab:red", "acco-bf16-extrap120": "tab:purple", "sync": "tab:gray",
              "dpu": "tab:brown", "dpu-ef": "tab:pink", "acco-int8": "tab:olive", "ddp-powersgd": "tab:cyan",
              "ddp-fp16": "darkgoldenrod"}
    for m in METHODS:
        ends: Dict[int, List[float]] = {}
        for r in rs:
            if r["method"] == m and r["kind"] == "branch" and float(r["floor"]) == 0.0:
                ends.setdefault(int(r["T"]), []).append(r["final_val_loss"])
        if ends:
            ts = sorted(ends)
            axes[0].plot(ts, [statistics.fmean(ends[t]) for t in ts], "o-", label=label(m, args), color=colors.get(m))
        trunk = next((r for r in rs if r["method"] == m and r["kind"] == "trunk" and int(r["seed"]) == args.seeds[0]), None)
        if trunk:
            axes[1].plot(*zip(*trunk["val"]), label=f"{label(m, args)} (seed {args.seeds[0]})", color=colors.get(m))
    axes[0].set_xlabel(f"run length T (updates), peak LR {args.lr:g}, cooled down to 0")
    axes[0].set_ylabel("final held-out loss (mean over seeds)")
    axes[0].set_xscale("log")
    axes[1].set_xlabel("update")
    axes[1].set_ylabel(f"held-out loss at the constant LR {args.lr:g} (trunk)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_name(args: argparse.Namespace) -> str:
    """The report's plot, beside its page and named after it (two studies' pages in one folder keep their own)."""
    return args.doc.with_suffix(".png").name


def report(args: argparse.Namespace) -> dict:
    records = load_records(args.records)
    if not records:
        raise SystemExit(f"no records in {args.records}: run the study first")
    s = summarize(records, args)
    speed = speeds(args.speed)
    write_block(args.doc, report_markdown(s, args, speed), BEGIN, END)
    if not args.no_plots:
        plot(records, args, args.doc.parent / plot_name(args))
    print(f"report: {s['records']} records -> {args.doc}", flush=True)
    return s


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=Path, default=None,
                   help="default: docs/convergence_data/time_to_target.jsonl (with --optimizer muon, ttt_muon.jsonl)")
    p.add_argument("--doc", type=Path, default=None,
                   help="default: docs/studies/time-to-target.md (with --optimizer muon, time-to-target-muon.md)")
    p.add_argument("--workdir", type=Path, default=ROOT / "runs" / "time_to_target")
    p.add_argument("--speed", type=Path, nargs="+",
                   default=[ROOT / "docs" / "benchmarks_data" / f"time_to_target_speed{x}.jsonl"
                            for x in ("", "_extrap", "_h3", "_sync", "_extrap61")],
                   help="benchmarks/time_to_target.py speed records of these methods on the testbed (time per "
                        "update), one benchmark run per file; a method in several files gets a composed row for each")
    p.add_argument("--methods", type=lambda s: s.split(","), default=["ddp", "acco-bf16", "acco"],
                   help="DDP first, then the ACCO methods; the first of them (by default the bf16 estimate with the "
                        "paper's step, the library's default until 2026-11-29) also runs at the other warm-ups")
    p.add_argument("--lr", type=float, default=4e-3,
                   help="DDP's best LR under this schedule (4e-3 at warm-up 100, 3 seeds): every method runs here")
    p.add_argument("--ddp-lrs", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                   help="other LRs where DDP alone runs")
    p.add_argument("--acco-lrs", type=lambda s: [float(x) for x in s.split(",") if x], default=[2e-3],
                   help="other LRs where DDP and every ACCO method run too (2e-3: the LR study's best for DDP, at "
                        "warm-up 20 and a cosine, the study's first target, and DDP's best at warm-up 20 here); at "
                        "the other warm-ups, DDP and the first ACCO method")
    p.add_argument("--warmups", type=lambda s: [int(x) for x in s.split(",")], default=[100, 20],
                   help="the first is the main one (covers the plateau escape); the others: DDP and the first ACCO "
                        "method, at --lr and --acco-lrs")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[500, 1500])
    p.add_argument("--floors", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.1])
    p.add_argument("--cooldown-frac", type=float, default=0.2)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="muon: the Muon + AdamW split in both loops; the LRs (--lr, --ddp-lrs, --acco-lrs) are then "
                        "Muon's, and the AdamW groups' peak is --adamw-lr")
    p.add_argument("--adamw-lr", type=float, default=2e-3, help="with --optimizer muon: the AdamW groups' peak LR")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=16)
    p.add_argument("--cap-first", action="store_true",
                   help="for methods expected beyond the longest length searched (1.5x DDP's): run that length right "
                        "after DDP's own, and stop there if it misses DDP's loss too (three runs fewer than the walk "
                        "through every length; one more where it reaches the loss, and every trunk runs to its start)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the next job and stop")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    muon = args.optimizer == "muon"
    if args.records is None:
        args.records = ROOT / "docs" / "convergence_data" / ("ttt_muon.jsonl" if muon else "time_to_target.jsonl")
    if args.doc is None:
        args.doc = ROOT / "docs" / "studies" / ("time-to-target-muon.md" if muon else "time-to-target.md")
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown method(s) {sorted(unknown)}: choose from {sorted(METHODS)}")
    if args.methods[0] != "ddp":
        p.error("--methods must start with ddp: every target is DDP's")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.dry_run:
        print(next_job(args, load_records(args.records)))
        return
    if not args.report_only:
        run_missing(args)
    report(args)


if __name__ == "__main__":
    main()
