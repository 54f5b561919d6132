"""Byte-level text data: no tokenizer, no download.

The default corpus is the Python standard library's own ``.py`` sources on the
running interpreter. Files are split into train / held-out by a hash of their
path, so the split is the same for every run and rank.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import List, Optional

import torch


def _files(root: Path) -> List[Path]:
    if root.is_file():
        return [root]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith((".py", ".txt", ".md", ".rst"))]
    return out


def load_corpus(path: Optional[str], eval_fraction: float = 0.05):
    """Return ``(train, held_out)`` uint8 tensors of bytes."""
    root = Path(path) if path else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise SystemExit(f"--data {root}: no such file or folder")
    files = _files(root)
    if not files:
        raise SystemExit(f"--data {root}: no .py/.txt/.md/.rst files found")
    train, held = bytearray(), bytearray()
    for f in files:
        data = f.read_bytes()
        if len(files) == 1:  # one file: hold out its tail
            cut = int(len(data) * (1 - eval_fraction))
            return _tensor(data[:cut]), _tensor(data[cut:])
        bucket = int.from_bytes(hashlib.sha1(str(f.relative_to(root)).encode()).digest()[:4], "little") / 2**32
        (held if bucket < eval_fraction else train).extend(data + b"\n")
    return _tensor(train), _tensor(held)


def _tensor(b) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()


def sample_batch(data: torch.Tensor, n: int, seq_len: int, gen: torch.Generator):
    """``n`` random windows: inputs and next-byte targets (int64)."""
    starts = torch.randint(0, len(data) - seq_len - 1, (n,), generator=gen)
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def eval_batches(data: torch.Tensor, n_batches: int, n: int, seq_len: int):
    """A fixed held-out set: the same windows for every run."""
    gen = torch.Generator().manual_seed(1234)
    return [sample_batch(data, n, seq_len, gen) for _ in range(n_batches)]
