"""Tables (markdown) and a plot from overlap.py / hetero.py / memory.py records.

    .venv/bin/python benchmarks/report.py runs/bench/overlap.jsonl runs/bench/hetero.jsonl \\
        runs/bench/memory.jsonl --plot docs/benchmarks_overlap.png

Every point is run several times (``repeat`` in the records; older records
without it count as repeat 0). Ratios are taken per repeat, between runs of
the same repeat, then summarised as ``median [min–max]`` over repeats: a
utilisation is tokens/s over the compute-only tokens/s of the same repeat, and
``best`` is the better of torch DDP and DDP+ZeRO in that repeat.

The model columns are the update-time model of ``acco.probe.predict``: with
``x = T_round / T_half`` (``T_half``: one micro-batch, from the compute-only
run; ``T_round``: sync's rounds, which nothing overlaps; medians over repeats),
acco's utilisation is ``1 / max(1, x)`` and sync's ``2 / (2 + x)``; dpu is
acco's in the awc loop (a round per micro-batch) and ``1 / max(1, x/2)`` in the
update loop (a round per update).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from acco.probe import predict  # noqa: E402

BEST = "best"  # per repeat: max(ddp, ddp-zero) tokens/s
TARGET_COPIES = 1.25  # memory target: peak(method) - peak(ddp-zero) in parameter-sized copies


def load(path: Path) -> list:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in records:  # records written before repeats, dtypes and loops existed
        r.setdefault("repeat", 0)
        r.setdefault("dtype", "fp32")
        r.setdefault("loop", "awc")
    return records


def stat(values, fmt: str = "{:.2f}") -> str:
    """``median [min–max]`` of the per-repeat values that exist ('' if none; the value alone if one)."""
    v = [x for x in values if x is not None]
    if not v:
        return ""
    med = fmt.format(statistics.median(v))
    return med if len(v) == 1 else f"{med} [{fmt.format(min(v))}–{fmt.format(max(v))}]"


def median(values):
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def fmt_rate(rate) -> str:
    return "loopback" if rate is None else f"{rate:g}"


class Point:
    """The runs of one sweep point: ``runs[label][repeat]`` is a record."""

    def __init__(self):
        self.runs = defaultdict(dict)

    def repeats(self) -> list:
        return sorted({k for by_repeat in self.runs.values() for k in by_repeat})

    def get(self, label, repeat, key="tokens_per_s"):
        r = self.runs.get(label, {}).get(repeat)
        return None if r is None else r.get(key)

    def tokens(self, label, repeat):
        if label == BEST:
            a, b = self.tokens("ddp", repeat), self.tokens("ddp-zero", repeat)
            return max(a, b) if a and b else None
        return self.get(label, repeat)

    def values(self, fn) -> list:
        """``fn(repeat)`` for every repeat (None where it has no value)."""
        return [fn(k) for k in self.repeats()]

    def field(self, label, key="tokens_per_s") -> list:
        """Per repeat: ``key`` of the run of ``label`` (None where it did not run)."""
        return [self.get(label, k, key) for k in self.repeats()]

    def ratio(self, num, den) -> list:
        """Per repeat: tokens/s of ``num`` over tokens/s of ``den`` (a label or BEST) in the same repeat."""
        def one(k):
            a, b = self.tokens(num, k), self.tokens(den, k)
            return a / b if a and b else None
        return self.values(one)

    def summary(self, label, key) -> list:
        def one(k):
            s = self.get(label, k, "summary") or {}
            return s.get(key) if s.get("rounds") else None
        return self.values(one)

    def t_half(self) -> list:
        """Per repeat: one micro-batch of compute, from the compute-only run."""
        def one(k):
            c = self.runs.get("compute", {}).get(k)
            return c and c["world"] * c["micro_batch"] * c["seq_len"] / c["tokens_per_s"]
        return self.values(one)

    def x(self) -> list:
        return [tr / th if tr and th else None for tr, th in zip(self.summary("sync", "round_s"), self.t_half())]


def points(records, tag: str) -> dict:
    """{(world, dtype, loop): {rate: Point}} for the records of ``tag``, rates from fastest to slowest."""
    out = defaultdict(lambda: defaultdict(Point))
    for r in sorted((r for r in records if r.get("tag") == tag), key=lambda r: -(r["rate_mbit"] or 0)):
        out[(r["world"], r["dtype"], r["loop"])][r["rate_mbit"]].runs[r["label"]][r["repeat"]] = r
    return out


def setting_title(setting, pts) -> str:
    world, dtype, loop = setting
    n = max(len(p.repeats()) for p in pts.values())
    return f"{world} ranks, {dtype}, loop {loop}; median [min–max] over {n} repeat(s)"


def overlap_table(setting, pts) -> str:
    rows = ["| rate Mbit/s | T_half ms | T_round ms (sync) | x = T_round/T_half | method | tokens/s | vs ddp | vs acco | "
            "utilisation | model | round ms | hidden |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate, p in pts.items():
        th, tr = median(p.t_half()), median(p.summary("sync", "round_s"))
        model = {}
        if th and tr:
            pred = predict(th, tr)
            model = {"acco": 2 * th / pred.acco_update_s, "sync": 2 * th / pred.sync_update_s, "compute": 1.0}
            model["dpu"] = model["acco"] if setting[2] == "awc" else 2 * th / max(2 * th, tr)
        ms = "{:.0f}"
        head = [fmt_rate(rate), stat([t and t * 1e3 for t in p.t_half()], ms),
                stat([t and t * 1e3 for t in p.summary("sync", "round_s")], ms), stat(p.x())]
        for label in p.runs:
            m = model.get(label)  # variants such as acco:ring0 have no model column
            rounds = [t and t * 1e3 for t in p.summary(label, "round_s")]
            against = [stat(p.ratio(label, d)) if d != label else "" for d in ("ddp", "acco")]  # "" where d did not run
            cells = head + [label, stat(p.field(label), ms)] + against + [
                            stat(p.ratio(label, "compute"), "{:.3f}"), "" if m is None else f"{m:.3f}",
                            stat(rounds, ms), stat(p.summary(label, "hidden"))]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def ratio_table(pts) -> str:
    rows = ["| rate Mbit/s | x | acco / ddp-zero | acco / ddp | acco / best of (ddp, ddp-zero) | acco / sync | "
            "acco (gloo collectives) / acco (ring) | round ms, gloo collectives -> ring |",
            "|---|---|---|---|---|---|---|---|"]
    for rate, p in pts.items():
        if "acco" not in p.runs:
            continue
        cells = [fmt_rate(rate), stat(p.x())] + [stat(p.ratio("acco", d)) for d in ("ddp-zero", "ddp", BEST, "sync")]
        native, ring = median(p.summary("acco:ring0", "round_s")), median(p.summary("acco", "round_s"))
        cells += [stat(p.ratio("acco:ring0", "acco")),
                  f"{native * 1e3:.0f} -> {ring * 1e3:.0f}" if native and ring else ""]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


COMPRESSION_BASES = ("ddp", "ddp-fp16", "ddp-powersgd", "acco:estimate-bf16")
# the default before issue 77's fix of the estimate's weights (7073ecf, imported from a worktree: overlap.py's "@")
OLD_DEFAULT = "acco:estimate-bf16@/tmp/acco-7073/src"
FIDELITY_BASES = ("ddp", OLD_DEFAULT)


def compression_table(pts, bases=COMPRESSION_BASES) -> str:
    """Each method against ``bases`` (``tag compression``: DDP, DDP with torch's hooks and ACCO's default; ``tag
    fidelity-speed``: DDP and the default of 7073ecf): per method its tokens/s, the ratios to each base (per
    repeat), the share of communication hidden, and the bytes rank 0's interface sent per update (netns)."""
    rows = ["| rate Mbit/s | x | method | tokens/s | " + " | ".join(f"vs {b}" for b in bases)
            + " | hidden | MB sent per update (rank 0) |", "|---" * (6 + len(bases)) + "|"]
    for rate, p in pts.items():
        for label in p.runs:
            cells = [fmt_rate(rate), stat(p.x()), label, stat(p.field(label), "{:.0f}")]
            cells += [stat(p.ratio(label, b)) if b != label and b in p.runs else "" for b in bases]
            sent = [b and b / 1e6 for b in p.field(label, "tx_bytes_per_update")]
            cells += [stat(p.summary(label, "hidden")), stat(sent, "{:.1f}")]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def hetero_table(pts) -> str:
    rows = ["| rate Mbit/s | method | tokens/s | vs sync | vs ddp-zero | vs ddp | vs best of (ddp, ddp-zero) | "
            "micro-batches per round, by rank (median) | hidden |", "|---|---|---|---|---|---|---|---|---|"]
    for rate, p in pts.items():
        for label in p.runs:
            per_rank = [s["microbatches_per_rank"] for s in p.field(label, "summary") if s and s.get("rounds")]
            mb = ", ".join(f"{statistics.median(col):.2f}" for col in zip(*per_rank)) if per_rank else ""
            cells = [fmt_rate(rate), label, stat(p.field(label), "{:.0f}")]
            cells += [stat(p.ratio(label, d)) for d in ("sync", "ddp-zero", "ddp", BEST)]
            rows.append("| " + " | ".join(cells + [mb, stat(p.summary(label, "hidden"))]) + " |")
    return "\n".join(rows)


def plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    settings = points(records, "overlap")
    names = {"acco:ring0": "acco, gloo's own collectives (ACCO_RING=0)", "ddp-zero": "torch DDP + ZeRO",
             "ddp": "torch DDP"}
    for setting, pts in settings.items():
        series = defaultdict(list)
        for p in pts.values():
            xs = p.x()
            for label in p.runs:
                util = p.ratio(label, "compute")
                if label == "compute" or median(xs) is None or median(util) is None:
                    continue
                series[label].append((median(xs), median(util), min(u for u in util if u), max(u for u in util if u)))
        suffix = "" if len(settings) == 1 else f" ({setting[0]} ranks, {setting[1]}, {setting[2]})"
        for label, pts_ in sorted(series.items()):
            pts_.sort()
            x, u, ulo, uhi = zip(*pts_)
            ax.errorbar(x, u, yerr=[[a - b for a, b in zip(u, ulo)], [b - a for a, b in zip(u, uhi)]],
                        fmt="o-", capsize=3, label=names.get(label, label) + suffix)
    xs = [i / 100 for i in range(10, 260)]
    ax.plot(xs, [1 / max(1.0, x) for x in xs], "k--", lw=1, label="model: acco 1/max(1, x)")
    ax.plot(xs, [2 / (2 + x) for x in xs], "k:", lw=1, label="model: sync 2/(2+x)")
    ax.set_xlabel("x = T_round / T_half (round time / one micro-batch of compute)")
    ax.set_ylabel("utilisation = tokens/s / compute-only tokens/s")
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ranks = ", ".join(str(w) for w in sorted({r["world"] for r in records}))
    ax.set_title(f"{ranks} ranks, gloo, rate-limited veth (netns); GPT {max(r['params'] for r in records) / 1e6:.1f}M "
                 "params\nmedian over repeats (x: median), bars: min–max of the utilisation", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def memory_points(records) -> dict:
    """{(ranks, dtype): Point}; ``dtype`` is the comparison's (ddp-zero-amp belongs to bf16)."""
    out = defaultdict(Point)
    for r in records:
        key = (r.get("ranks", r["world"]), r.get("point_dtype", r["dtype"]))
        out[key].runs[r["label"]][r["repeat"]] = r
    return dict(sorted(out.items()))


def peaks(p: Point, label) -> list:
    """Per repeat: the peak RSS of the run of ``label``, the largest of its ranks'."""
    return [max(rss) if rss else None for rss in p.field(label, "peak_rss_bytes")]


def minus(a: list, b: list) -> list:
    return [x - y if x is not None and y is not None else None for x, y in zip(a, b)]


def memory_table(records) -> str:
    """Peak RSS per run, and above the compute-only run (the column only where some point has one: memory.py's
    ``--methods`` without ``compute`` records none)."""
    points = memory_points(records)
    baseline = any("compute" in p.runs for p in points.values())
    rows = ["| ranks | dtype | method | peak RSS MiB (max over ranks) | " + ("above compute-only MiB | " if baseline else "")
            + "buffers MiB (by the library's / torch's own count) |", "|---" * (6 if baseline else 5) + "|"]
    mib = "{:.0f}"
    for (ranks, dtype), p in points.items():
        for label, by_repeat in p.runs.items():
            above = minus(peaks(p, label), peaks(p, "compute"))
            mems = [r.get("memory") or {} for r in by_repeat.values()]
            keys = dict.fromkeys(k for m in mems for k in m)
            detail = ", ".join(f"{k} {median([m.get(k) for m in mems]) / 2**20:.1f}" for k in keys
                               if median([m.get(k) for m in mems]))
            cells = [str(ranks), dtype, label, stat([v and v / 2**20 for v in peaks(p, label)], mib)]
            cells += [stat([v and v / 2**20 for v in above], mib)] if baseline else []
            rows.append("| " + " | ".join(cells + [detail]) + " |")
    return "\n".join(rows)


def copy_bytes(r, unit: str) -> int:
    """One parameter-sized copy in fp32 or in the run's compute dtype (from ``params`` for older records)."""
    key = f"param_bytes_{unit}"
    if key in r:
        return r[key]
    return r["params"] * (2 if unit == "compute" and r["dtype"] in ("bf16", "amp") else 4)


def memory_target_table(records) -> str:
    rows = ["| ranks | dtype | method | against | peak - peak(against) MiB | in fp32 copies | in compute-dtype copies | "
            f"median ≤ {TARGET_COPIES} (fp32 / compute copies) |", "|---|---|---|---|---|---|---|---|"]
    for (ranks, dtype), p in memory_points(records).items():
        for base in ("ddp-zero", "ddp-zero-amp"):
            if base not in p.runs:
                continue
            for label in ("acco", "dpu", "sync"):
                if label not in p.runs:
                    continue
                diff = minus(peaks(p, label), peaks(p, base))
                rec = next(iter(p.runs[label].values()))
                copies = {u: [d and d / copy_bytes(rec, u) for d in diff] for u in ("fp32", "compute")}
                ok = " / ".join("yes" if median(v) is not None and median(v) <= TARGET_COPIES else "no"
                                for v in copies.values())
                mib = stat([d and d / 2**20 for d in diff], "{:.0f}")
                rows.append(f"| {ranks} | {dtype} | {label} | {base} | {mib} | {stat(copies['fp32'])} | "
                            f"{stat(copies['compute'])} | {ok} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    records = [r for f in args.files for r in load(f)]
    for setting, pts in points(records, "overlap").items():
        print(f"## Overlap sweep ({setting_title(setting, pts)})\n\n" + overlap_table(setting, pts) + "\n\n"
              + ratio_table(pts) + "\n")
    for setting, pts in points(records, "compression").items():
        print(f"## Compressed rounds ({setting_title(setting, pts)})\n\n" + compression_table(pts) + "\n")
    for setting, pts in points(records, "fidelity-speed").items():
        print(f"## The default across issue 77's change ({setting_title(setting, pts)})\n\n"
              + compression_table(pts, FIDELITY_BASES) + "\n")
    for setting, pts in points(records, "hetero").items():
        print(f"## Heterogeneous ranks ({setting_title(setting, pts)})\n\n" + hetero_table(pts) + "\n")
    memory = [r for r in records if r.get("tag") == "memory"]
    if memory:
        n = max(r["repeat"] for r in memory) + 1
        print(f"## Memory (median [min–max] over {n} repeat(s))\n\n" + memory_table(memory) + "\n\n"
              + memory_target_table(memory) + "\n")
    overlap = [r for r in records if r.get("tag") == "overlap"]
    if args.plot and overlap:
        plot(overlap, args.plot)


if __name__ == "__main__":
    main()
