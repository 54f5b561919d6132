"""What whole-tensor placement costs: bytes per round, padding and the Newton-Schulz load, from the layout alone.

    .venv/bin/python benchmarks/placement.py [--out docs/benchmarks_data/placement.json]

For two parameter lists, the example GPT of ``examples/gpt`` (4 layers x 128, the LR study's model) and GPT-2
small (shapes only, nanoGPT's order, tied head), and three ways to wrap their optimizer, at 2, 4 and 8 ranks:

* ``adamw``: every tensor sliced (the flat layout of the paper, the reference);
* ``muon+adamw``: the split users run: 2-D hidden matrices whole (Muon), embeddings and 1-D tensors sliced;
* ``adafactor``: every tensor whole.

Per case: the flat buffer's elements against the flat layout's, the bytes one rank sends per round (a ring's
reduce-scatter of fp32 gradients and all-gather of fp32 weights: ``2 (N-1)/N`` of the buffer, 4 bytes each),
and the Newton-Schulz FLOPs of the busiest rank as a share of the whole model's (torch DDP + Muon runs all of
them on every rank: 1.0) and against the mean over ranks. Pure arithmetic on ``acco.placement.Layout``: it
runs in a second and measures nothing on a network.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from acco.placement import SLICE, WHOLE, Layout, newton_schulz_flops  # noqa: E402


def example_gpt():
    """(name, shape) of the example GPT at the LR study's size (byte vocabulary, 64 positions)."""
    import torch  # noqa: F401  (the model module needs it)
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=64, d_model=128, n_layers=4, n_heads=4, local_window=64))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def gpt2_small():
    """(name, shape) of GPT-2 small in nanoGPT's order (the head is tied to the token embedding)."""
    out = [("wte", (50304, 768)), ("wpe", (1024, 768))]
    for b in range(12):
        for n, s in (("ln_1.weight", (768,)), ("ln_1.bias", (768,)), ("attn.c_attn.weight", (2304, 768)),
                     ("attn.c_attn.bias", (2304,)), ("attn.c_proj.weight", (768, 768)), ("attn.c_proj.bias", (768,)),
                     ("ln_2.weight", (768,)), ("ln_2.bias", (768,)), ("mlp.c_fc.weight", (3072, 768)),
                     ("mlp.c_fc.bias", (3072,)), ("mlp.c_proj.weight", (768, 3072)), ("mlp.c_proj.bias", (768,))):
            out.append((f"h.{b}.{n}", s))
    return out + [("ln_f.weight", (768,)), ("ln_f.bias", (768,))]


def hidden(name: str, shape) -> bool:
    """Muon's share of the split: 2-D matrices that are not embeddings (tok, pos, wte, wpe) or the head."""
    return len(shape) == 2 and not any(k in name for k in ("tok", "pos", "wte", "wpe", "head"))


def case(params, setup: str, world: int) -> dict:
    shapes = [s for _, s in params]
    if setup == "adamw":
        kinds = [SLICE] * len(shapes)
    elif setup == "adafactor":
        kinds = [WHOLE] * len(shapes)
    else:
        kinds = [WHOLE if hidden(n, s) else SLICE for n, s in params]
    ns = [newton_schulz_flops(s) if k == WHOLE and len(s) == 2 and setup == "muon+adamw" else 0.0
          for s, k in zip(shapes, kinds)]
    costs = ns if setup == "muon+adamw" else None
    layout = Layout.build(shapes, world, kinds, costs)
    flat = Layout.build(shapes, world)
    load = layout.load(ns) if setup == "muon+adamw" else [0.0] * world
    total = sum(ns)
    return {
        "setup": setup, "ranks": world, "numel": layout.numel, "buffer": layout.padded_numel,
        "flat_buffer": flat.padded_numel, "buffer_vs_flat": layout.padded_numel / flat.padded_numel,
        "padding": layout.padding / layout.numel,
        "bytes_per_round": int(2 * (world - 1) / world * layout.padded_numel * 4),
        "ns_busiest_share": max(load) / total if total else None,
        "ns_max_over_mean": max(load) / (total / world) if total else None,
        "ns_ranks_busy": sum(1 for x in load if x > 0),
    }


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows = []
    for model, params in (("example GPT (0.84M)", example_gpt()), ("GPT-2 small (124M)", gpt2_small())):
        for setup in ("adamw", "muon+adamw", "adafactor"):
            for world in (2, 4, 8):
                rows.append({"model": model, **case(params, setup, world)})
    print("| model | optimizer | ranks | buffer / flat layout | padding | MB sent per round per rank | "
          "Newton-Schulz: busiest rank's share (DDP+Muon: 1.0) | max / mean | ranks with NS work |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ns = (f"{r['ns_busiest_share']:.3f} | {r['ns_max_over_mean']:.2f} | {r['ns_ranks_busy']}"
              if r["ns_busiest_share"] is not None else "— | — | —")
        print(f"| {r['model']} | {r['setup']} | {r['ranks']} | {r['buffer_vs_flat']:.4f} | {r['padding']:.2%} | "
              f"{r['bytes_per_round'] / 1e6:.2f} | {ns} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
