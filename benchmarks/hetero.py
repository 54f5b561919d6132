"""Heterogeneous ranks: rank 1 is 2x slower (it sleeps as long again as it computes).

    sudo .venv/bin/python benchmarks/hetero.py --rates 125 --out runs/bench/hetero.jsonl

acco that accumulates while a round is in flight (``acco-acc``) against acco
with one micro-batch per round, sync ZeRO-1, torch DDP and torch DDP+ZeRO; the
records carry each rank's micro-batches per round. Same options as
``overlap.py`` (``--repeats``, interleaved methods).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overlap  # noqa: E402

if __name__ == "__main__":
    overlap.main(rates="125", methods="compute,acco-acc,acco,sync,ddp,ddp-zero", slow_rank=1, slow_factor=2.0,
                 tag="hetero", out=Path("runs/bench/hetero.jsonl"))
