"""How many extra updates at my scale? (docs/studies/at-my-scale.md): the time-to-target records at every batch and
width, side by side, the power laws through them, and what those laws predict for a larger run.

    python examples/nanogpt/at_my_scale.py                    # the block of docs/studies/at-my-scale.md
    python examples/nanogpt/at_my_scale.py --width 768 --tokens 524288 --print

Each set-up (a model and a batch) is one ``config`` of the time-to-target records (``time_to_target.py``, AdamW,
warm-up 100, WSD, ``T`` = 500, cooled to 0). Its point is the bf16 estimate's (``acco-bf16``, the paper's step: the
default until 2026-11-29, the one run at every set-up) updates ratio at DDP's
best LR for that set-up (the lowest mean of DDP's fully decayed losses over the seeds every LR shares), per seed
and on the mean, computed from the records as the time-to-target report computes a finished search (a seed whose
search is still going on is left out here).

The extra updates ``e = ratio - 1`` are fitted as power laws by least squares in log-log space: against the width
at the base batch (16,384 tokens, 4 layers), and against the tokens per update at the base width (128). Each law
is fitted on every point, again on the 3-seed points where some point has fewer, and is also taken flat (no
change from the base point): for the batch because delay theory and the estimate's noise pull it opposite ways
(issue #49), for the width because a fit through a few points need not hold beyond them, and the points need not
lie on one law (docs/studies/at-my-scale.md says where they do not). The prediction for ``--width`` and
``--tokens`` is the base point's extra updates times both laws, for each pair of fits; it is a prediction, not a
measurement: depth is not varied and the laws rest on few points.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from study import ROOT, load_records, write_block  # noqa: E402
from time_to_target import branches_of, ddp_best_lrs, search_state, target_of  # noqa: E402

RECORDS = ["time_to_target.jsonl", "ttt_batch.jsonl", "ttt_batch65k.jsonl", "ttt_width.jsonl", "ttt_width256.jsonl"]
METHOD, WARMUP, T, FLOOR = "acco-bf16", 100, 500, 0.0
BASE_WIDTH, BASE_TOKENS, BASE_LAYERS = 128, 16384, 4
BEGIN, END = "<!-- at-my-scale:begin (written by examples/nanogpt/at_my_scale.py) -->", "<!-- at-my-scale:end -->"


def tokens_of(config: dict) -> int:
    """Tokens per update: sequences per micro-batch x sequence length x micro-batches x ranks."""
    return config["batch_size"] * config["block_size"] * config["gradient_accumulation_steps"] * config["world_size"]


def points(records: List[dict]) -> List[dict]:
    """One point per AdamW set-up with DDP and the default at DDP's best LR: ``{"width", "layers", "tokens",
    "lr", "lrs", "ratios": {seed: ratio}, "bounds": {seed: "> 1.167"}, "mean"}``. A seed whose search is not
    done is left out; one whose target lies beyond the lengths searched is a bound, and leaves the mean out."""
    by_config: Dict[tuple, List[dict]] = {}
    for r in records:
        if "optimizer" not in r["config"] and int(r["warmup"]) == WARMUP:
            by_config.setdefault(tuple(sorted(r["config"].items())), []).append(r)
    out = []
    for items, recs in by_config.items():
        config = dict(items)
        ddp = [{"lr": float(r["lr"]), "warmup": WARMUP, "seed": int(r["seed"]), "T": int(r["T"]),
                "floor": float(r["floor"]), "loss": r["final_val_loss"]}
               for r in recs if r["kind"] == "branch" and r["method"] == "ddp"]
        best = ddp_best_lrs(ddp).get((WARMUP, T, FLOOR))
        if best is None:
            continue
        lr, lrs = best
        ratios, bounds = {}, {}
        for seed in sorted({d["seed"] for d in ddp if d["lr"] == lr and d["T"] == T and d["floor"] == FLOOR}):
            line = {"method": METHOD, "lr": lr, "warmup": WARMUP, "seed": seed}
            target = target_of(recs, line, config, T, FLOOR)
            _, result = search_state(branches_of(recs, line, config), target, T, FLOOR)
            if result is None or result.get("searching"):
                continue
            if result["ratio"] is None:
                bounds[seed] = result["bound"]
            else:
                ratios[seed] = result["ratio"]
        if ratios or bounds:
            out.append({"width": config["n_embd"], "layers": config["n_layer"], "tokens": tokens_of(config),
                        "lr": lr, "lrs": lrs, "ratios": ratios, "bounds": bounds,
                        "mean": statistics.fmean(ratios.values()) if ratios and not bounds else None})
    return sorted(out, key=lambda p: (p["layers"], p["width"], p["tokens"]))


def power_law(xy: List[Tuple[float, float]]) -> Optional[float]:
    """The exponent ``a`` of ``y = c * x^a`` by least squares on ``(log x, log y)``; None below two distinct x or
    with a y that is not positive (a law through no extra updates has no log)."""
    if len({x for x, _ in xy}) < 2 or any(y <= 0 for _, y in xy):
        return None
    lx, ly = [math.log(x) for x, _ in xy], [math.log(y) for _, y in xy]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fits(pts: List[dict], axis: str) -> Dict[str, float]:
    """The exponents of the extra updates along ``axis`` ("width" at the base batch, "tokens" at the base width),
    4 layers: ``{"flat": 0.0, "all points": a, "3-seed points": a}``. A fit with too few points is left out, and so
    is the 3-seed fit where every point has 3 seeds (it is the same fit)."""
    other = {"width": ("tokens", BASE_TOKENS), "tokens": ("width", BASE_WIDTH)}[axis]
    on = [p for p in pts if p["layers"] == BASE_LAYERS and p[other[0]] == other[1] and p["mean"] is not None]
    out = {"flat": 0.0}
    every = power_law([(p[axis], p["mean"] - 1) for p in on])
    three = power_law([(p[axis], p["mean"] - 1) for p in on if len(p["ratios"]) >= 3])
    if every is not None:
        out["all points"] = every
    if three is not None and (every is None or len(on) != sum(len(p["ratios"]) >= 3 for p in on)):
        out["3-seed points"] = three
    return out


def predict(pts: List[dict], width: int, tokens: int) -> Tuple[Optional[dict], List[dict]]:
    """``(base point, [{"width_fit", "a", "tokens_fit", "b", "ratio"}])``: the base point's extra updates times
    ``(width / 128)^a * (tokens / 16,384)^b`` for each pair of fits."""
    base = next((p for p in pts if (p["layers"], p["width"], p["tokens"]) == (BASE_LAYERS, BASE_WIDTH, BASE_TOKENS)
                 and p["mean"] is not None), None)
    if base is None:
        return None, []
    out = []
    for wname, a in fits(pts, "width").items():
        for tname, b in fits(pts, "tokens").items():
            scale = (width / BASE_WIDTH) ** a * (tokens / BASE_TOKENS) ** b
            out.append({"width_fit": wname, "a": a, "tokens_fit": tname, "b": b,
                        "ratio": 1 + (base["mean"] - 1) * scale})
    return base, out


def _law(name: str, exponent: float) -> str:
    return "flat" if name == "flat" else f"^{exponent:+.2f} ({name})"


def markdown(pts: List[dict], width: int, tokens: int) -> str:
    rows = ["| model | tokens per update | DDP's best LR (of) | seeds | per seed | mean |", "|---|---|---|---|---|---|"]
    for p in pts:
        per = ", ".join([f"{p['ratios'][s]:.3f}" for s in sorted(p["ratios"])] +
                        [f"s{s} {b}" for s, b in sorted(p["bounds"].items())])
        mean = "—" if p["mean"] is None else f"{p['mean']:.3f}"
        rows.append(f"| {p['layers']} × {p['width']} | {p['tokens']:,} | {p['lr']:g} "
                    f"({', '.join(f'{x:g}' for x in p['lrs'])}) | {len(p['ratios']) + len(p['bounds'])} | {per} | "
                    f"{mean} |")
    base, preds = predict(pts, width, tokens)
    out = [BEGIN, "", f"The bf16 estimate's updates ratio at DDP's best LR ({METHOD}, warm-up {WARMUP}, WSD, `T` = {T}, "
           "cooled to 0), from the time-to-target records:", ""] + rows + [""]
    for axis, name in (("width", f"width, at {BASE_TOKENS:,} tokens"), ("tokens", f"tokens per update, at "
                                                                                f"{BASE_WIDTH} wide")):
        laws = fits(pts, axis)
        fitted = ", ".join(f"∝ {axis}^{a:+.2f} ({n})" for n, a in laws.items() if n != "flat")
        out.append(f"- Extra updates against the {name}: flat, or " + (
            fitted or "no fitted law (fewer than two points, or a point with no extra updates)") + ".")
    if base is not None and preds:
        lo, hi = min(p["ratio"] for p in preds), max(p["ratio"] for p in preds)
        out += ["", f"**Predicted, not measured**, at {width} wide and {tokens:,} tokens per update (4 layers' "
                f"laws; depth not varied): **{lo:.3f}–{hi:.3f}×** DDP's updates, from the base point's "
                f"{base['mean']:.3f}:", "", "| width law | batch law | predicted ratio |", "|---|---|---|"]
        out += [f"| {_law(p['width_fit'], p['a'])} | {_law(p['tokens_fit'], p['b'])} | {p['ratio']:.3f} |"
                for p in preds]
    out += ["", END]
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=Path, nargs="+",
                   default=[ROOT / "docs" / "convergence_data" / name for name in RECORDS])
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "studies" / "at-my-scale.md")
    p.add_argument("--width", type=int, default=768, help="the prediction's width (GPT-2 small: 768)")
    p.add_argument("--tokens", type=int, default=524288, help="the prediction's tokens per update (0.5M)")
    p.add_argument("--print", action="store_true", help="print the block instead of writing it into --doc")
    args = p.parse_args(argv)
    if args.width <= 0 or args.tokens <= 0:
        p.error(f"--width and --tokens must be positive, got {args.width} and {args.tokens}")
    if (args.width, args.tokens) != (p.get_default("width"), p.get_default("tokens")) and not args.print:
        p.error(f"the page's block is GPT-2 small's (768 wide, 524,288 tokens): for {args.width} wide and "
                f"{args.tokens:,} tokens pass --print")
    records = [r for path in args.records for r in load_records(path)]
    block = markdown(points(records), args.width, args.tokens)
    if args.print:
        print(block[len(BEGIN):-len(END)].strip())
        return
    write_block(args.doc, block, BEGIN, END)
    print(f"at my scale: {len(records)} records -> {args.doc}")


if __name__ == "__main__":
    main()
