"""The optimizers of the nanoGPT-style loops: AdamW, or the Muon + AdamW split, as lists of torch optimizers.

``configure_optimizers(model, "adamw", ...)``: AdamW with weight decay on the matrices (nanoGPT's groups).
``configure_optimizers(model, "muon", ...)``: torch's Muon on the 2-D hidden matrices (at ``muon_lr``), AdamW on
the embeddings and the 1-D tensors, as torch's Muon documentation builds the split. Every group carries
``lr_scale``: its rate over ``learning_rate``, so a loop that sets ``lr`` from a schedule sets each group's.
``Chain`` steps a list of optimizers as one (what the DDP loop steps; the acco loop hands the list to
``AccoOptimizer.from_optimizer``).
"""

from typing import List

import torch


def configure_optimizers(model, name: str, learning_rate: float, muon_lr: float, weight_decay: float,
                         betas) -> List[torch.optim.Optimizer]:
    hidden = ([p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("tok.", "pos."))]
              if name == "muon" else [])
    ids = {id(p) for p in hidden}
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in ids]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0}]
    adamw = torch.optim.AdamW(groups, lr=learning_rate, betas=betas)
    if name == "adamw":
        return [adamw]
    if name != "muon":
        raise SystemExit(f"--optimizer_name={name!r}: choose adamw or muon")
    muon = torch.optim.Muon([{"params": hidden, "lr_scale": muon_lr / learning_rate}], lr=muon_lr,
                            weight_decay=weight_decay)
    return [muon, adamw]


class Chain:
    """Several torch optimizers stepped as one; one optimizer behaves (and checkpoints) as itself."""

    def __init__(self, optimizers: List[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> List[dict]:
        """The optimizers' groups, read at each call: torch's ``load_state_dict`` replaces an optimizer's group
        dicts, so a list taken once would miss every ``lr`` a schedule sets after a resume."""
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        sds = [o.state_dict() for o in self.optimizers]
        return sds[0] if len(sds) == 1 else sds

    def load_state_dict(self, sd) -> None:
        for o, s in zip(self.optimizers, [sd] if len(self.optimizers) == 1 else sd):
            o.load_state_dict(s)
