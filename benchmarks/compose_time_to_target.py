"""Time to DDP's loss on a slow link, composed: updates to target (the time-to-target study) x time per update
(the compression benchmark on the testbed), against DDP.

    .venv/bin/python benchmarks/compose_time_to_target.py \\
        --speed docs/benchmarks_data/compression.jsonl --records docs/convergence_data/time_to_target.jsonl \\
        --longer docs/convergence_data/powersgd_long.jsonl

For each method and link rate: the method's updates to reach DDP's fully decayed held-out loss at T = 500
(``examples/nanogpt/time_to_target.py``: mean over the seeds of the interpolated ratio to DDP's 500, and its
range), times DDP's tokens/s over the method's (``benchmarks/overlap.py --tag compression``: per repeat, then
the median and range over repeats). The two come from different models on purpose: the updates from the
study's 0.84M-parameter loops (where 3 seeds of whole runs fit on 2 cores), the speed from the benchmark's
3.26M-parameter GPT at a measured ``x`` (a round over one micro-batch's compute). Composing them assumes the
updates ratio carries over to the benchmark's model; the study's own end-to-end check of that assumption is
``benchmarks/time_to_target.py e2e``. A method with seeds still missing is shown with the seeds it has. A seed
that had not reached DDP's loss by the study's longest run is a lower bound ("≥"), raised by ``--longer``'s
branches of that seed that still ended above it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "examples" / "nanogpt"))

import report  # noqa: E402

# the study's method -> the benchmark's label of the same method (both ACCO's default: the bf16 estimate, its
# step extrapolated by 1.2)
METHODS = {"ddp": "ddp", "acco-bf16-extrap120": "acco:estimate-bf16", "acco-int8": "acco-int8",
           "ddp-powersgd": "ddp-powersgd", "ddp-fp16": "ddp-fp16"}
NAMES = {"ddp": "DDP + AdamW", "acco-bf16-extrap120": "ACCO default", "acco-int8": "ACCO + int8",
         "ddp-powersgd": "DDP + PowerSGD (rank 4)", "ddp-fp16": "DDP + fp16 hook"}


def _study():
    spec = importlib.util.spec_from_file_location("nanogpt_time_to_target",
                                                  ROOT / "examples" / "nanogpt" / "time_to_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _longer(records: list) -> dict:
    """``(method, lr, warm-up, seed) -> [(T, final held-out loss)]`` of the fully decayed branches among
    ``records`` (``examples/nanogpt/powersgd_long.py``'s: run beyond the study's search)."""
    out: dict = {}
    for r in records:
        if r.get("kind") == "branch" and r.get("floor") == 0.0:
            out.setdefault((r["method"], r["lr"], r["warmup"], r["seed"]), []).append((r["T"], r["final_val_loss"]))
    return out


def updates_ratios(records: Path, longer: Optional[Path] = None) -> dict:
    """method -> per-seed ``(updates-to-target ratio, is a lower bound)`` at T = 500, warm-up 100, DDP's best LR
    (4e-3), floor 0. A seed that had not reached DDP's loss by the longest run searched gives that length's ratio,
    as a lower bound, or, where a longer branch of that seed (``longer``) still ended above DDP's loss, that
    branch's length over 500."""
    study = _study()
    beyond = _longer(study.load_records(longer) if longer is not None else [])  # none without the file
    args = study.parse(["--methods", ",".join(METHODS), "--warmups", "100", "--lengths", "500", "--floors", "0.0",
                        "--acco-lrs=", "--records", str(records), "--no-plots"])
    s = study.summarize(study.load_records(records), args)
    out = {"ddp": [(1.0, False)] * 3}
    for row in s["rows"]:
        res = row["result"] or {}
        if row["T"] != 500 or res.get("searching"):
            continue
        if res.get("ratio") is not None:
            out.setdefault(row["method"], []).append((res["ratio"], False))
        elif res.get("bound", "").startswith(">"):  # not at DDP's loss by the longest run searched: a lower bound
            above = [t / row["T"] for t, loss in beyond.get((row["method"], row["lr"], row["warmup"], row["seed"]), [])
                     if loss > row["target"]]
            out.setdefault(row["method"], []).append((max([res["at"], *above]), True))
    return out


def table(speed: Path, records: Path, longer: Optional[Path] = None) -> str:
    ratios = updates_ratios(records, longer)
    pts = next(iter(report.points(report.load(speed), "compression").values()))
    rows = ["| rate Mbit/s | x | method | updates to DDP's loss (seeds) | time per update / DDP's | "
            "time to DDP's loss / DDP's |", "|---|---|---|---|---|---|"]
    for rate, p in pts.items():
        x = statistics.median([v for v in p.x() if v])
        for method, label in METHODS.items():
            seeds = ratios.get(method)
            per = [1 / r for r in p.ratio(label, "ddp") if r]
            if not seeds or not per or label not in p.runs:
                continue
            us, at_least = [u for u, _ in seeds], "≥ " if any(b for _, b in seeds) else ""
            u, t = statistics.fmean(us), statistics.median(per)
            rows.append(f"| {rate:g} | {x:.1f} | {NAMES[method]} | {at_least}{u:.3f} [{min(us):.3f}–{max(us):.3f}] "
                        f"({len(us)}) | {t:.2f} [{min(per):.2f}–{max(per):.2f}] | {at_least}{u * t:.2f} "
                        f"[{min(us) * min(per):.2f}–{max(us) * max(per):.2f}] |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speed", type=Path, default=ROOT / "docs" / "benchmarks_data" / "compression.jsonl")
    p.add_argument("--records", type=Path, default=ROOT / "docs" / "convergence_data" / "time_to_target.jsonl")
    p.add_argument("--longer", type=Path, default=ROOT / "docs" / "convergence_data" / "powersgd_long.jsonl",
                   help="branches run beyond the study's search (powersgd_long.py), as longer lower bounds")
    args = p.parse_args(argv)
    print(table(args.speed, args.records, args.longer))


if __name__ == "__main__":
    main()
