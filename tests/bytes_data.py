"""Fixed rows of bytes of a stdlib source file, as a map-style dataset of GPT-2 inputs (no download)."""

import os
import sysconfig

import torch

SEQ = 64


class Bytes(torch.utils.data.Dataset):
    """``n`` rows of ``SEQ`` bytes of argparse.py from byte ``start``: ``input_ids`` and ``labels``."""

    def __init__(self, start: int, n: int) -> None:
        path = os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py")
        data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
        self.rows = [data[start + i * SEQ : start + (i + 1) * SEQ] for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}
