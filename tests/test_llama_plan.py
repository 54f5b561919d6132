"""torchtitan's whole Llama tensor-parallel plan inside a host, ACCO across hosts (issue 65, finding 1).

A two-block Llama (RMSNorm, attention with wq/wk/wv/wo, SwiGLU feed-forward, tied to nothing) planned as
torchtitan's ``apply_tp`` plans it: the embedding Rowwise into a sequence-sharded output, SequenceParallel
norms, ``PrepareModuleInput`` before attention and the feed-forward, Colwise/Rowwise projections with
sequence-sharded outputs, and the output layer Colwise into a vocabulary-sharded DTensor whose loss is computed
under ``loss_parallel()``. On a (2, 2) ('dp', 'tp') mesh, every update must equal the oracle on the unsharded
model with one rank per host.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _dist import run_ranks
from oracle import grads_at, update_run

from acco import AccoOptimizer

TOL = 1e-5
M, UPDATES = 2, 3
VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 16, 8, 2, 12, 4, 2
KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
SETTINGS = {"sync": ("sync", None), "acco": ("acco", None), "dpu": ("dpu", None), "acco-clipped": ("acco", 0.5)}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head = DIM // HEADS
        # -1 heads: all of them on the unsharded model, this rank's under tensor parallelism (as torchtitan)
        q, k, v = (w(x).view(b, s, -1, head).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_llama() -> Llama:
    torch.manual_seed(0)
    model = Llama()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norms that are not the identity: their (Partial) gradients matter
    return model


def apply_tp(model: Llama, tp_mesh) -> None:
    """torchtitan's Llama plan (``apply_tp`` with sequence parallelism and loss parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def _batch(host: int, index: int):
    g = torch.Generator().manual_seed(1000 * host + index + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _grad_fn(host: int, index: int, weights):
    x, y = _batch(host, index)
    return grads_at(Llama(), weights, lambda model: F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1)) / M)


def _worker(rank: int, world: int, fsdp: bool) -> dict:
    """``fsdp``: FSDP2 on top of the plan, on a ('dp', 'shard', 'tp') mesh of (2, 1, 2), as torchtitan applies it
    after tensor parallelism (2-D DTensors; the shard dimension of one rank keeps the oracle's hosts)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    if fsdp:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "shard", "tp"))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    host = mesh.get_local_rank("dp")
    out = {}
    for name, (mode, clip) in SETTINGS.items():
        model = make_llama()
        theta0 = [p.detach().clone() for p in model.parameters()]
        apply_tp(model, mesh["tp"])
        if fsdp:
            for block in model.layers:
                fully_shard(block, mesh=mesh["shard"])
            fully_shard(model, mesh=mesh["shard"])
        opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode=mode, microbatches_per_update=M,
                            process_group=mesh["dp"], estimate_dtype=None, max_grad_norm=clip, **KW)
        traj = []
        for t in range(UPDATES):
            for j in range(M):
                x, y = _batch(host, t * M + j)
                with loss_parallel():  # the vocabulary-sharded logits' cross-entropy, as torchtitan computes it
                    (F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1)) / M).backward()
            opt.step()
            opt.zero_grad()
            traj.append([p.full_tensor().clone() for p in model.parameters()])
        opt.finish()
        ref_steps, _, _ = update_run(theta0, lambda ps: torch.optim.AdamW(ps, **KW), mode, _grad_fn, 2, UPDATES, M,
                                     max_grad_norm=clip, estimate_extrapolation=opt.estimate_extrapolation)
        err = max(float((a - b).abs().max() / b.abs().max()) for st, ref in zip(traj, ref_steps)
                  for a, b in zip(st, ref))
        moved = max(float((a - b).abs().max()) for a, b in zip(traj[-1], theta0))
        out[name] = {"err": err, "moved": moved}
    return out


@functools.lru_cache(maxsize=None)
def _results(fsdp: bool):
    return run_ranks(_worker, 4, fsdp)


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tp", "tp+fsdp2"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_torchtitan_llama_plan_equals_the_oracle(setting, fsdp):
    for rank, res in enumerate(_results(fsdp)):
        r = res[setting]
        assert r["moved"] > 1e-3, (rank, r)
        assert r["err"] < TOL, (rank, r)
