"""The LR study's diagnostic (``study.py``): how far ACCO's estimate is from the weights it stands for."""

import torch


class EstimateGap:
    """After ``step()``: ``|theta~_{t+1} - theta_{t+1}|`` (what the model holds, in mode acco the estimate,
    against the committed update) and ``|theta_{t+1} - theta_t|``. Waits for every commit: a diagnostic."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.previous = self._flat()

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.model.parameters()])

    def __call__(self, optimizer) -> dict:
        held = self._flat()
        with optimizer.committed_weights():
            committed = self._flat()
        out = {"estimate_gap": (held - committed).norm().item(), "update_norm": (committed - self.previous).norm().item()}
        self.previous = committed
        return out
