"""A model larger than one device, the torchtitan way: tensor parallelism and FSDP2 inside a host, ACCO across hosts.

    torchrun --nproc_per_node=4 examples/mesh/train.py --dp 2 --shard 1 --tp 2 --ckpt runs/mesh   # CPU, gloo
    torchrun --nproc_per_node=4 examples/mesh/train.py --dp 2 --shard 1 --tp 2 --ckpt runs/mesh   # again: resumes

The mesh is ``("dp", "shard", "tp")``: ``dp`` hosts (ACCO's data-parallel dimension, over the slow links),
each with ``shard x tp`` ranks (FSDP2 and tensor parallelism, over the fast ones). The model is a small
llama-shaped decoder (RMSNorm, separate q/k/v projections, SwiGLU) on bytes of text
(``examples/gpt/data.py``: the Python standard library's sources unless ``--data`` names a file or folder).
Tensor parallelism splits every block's projections on ``mesh["tp"]``; the embeddings, the norms and the
output head stay plain (replicated on ``mesh["tp"]``). FSDP2 then shards every block and the root on
``mesh["shard"]``. ``AccoOptimizer`` gets ``process_group=mesh["dp"]``.

The ranks of one tensor-parallel group read the same batch; every other rank reads its own. With ``--ckpt``,
``acco.checkpoint.save`` writes ``CKPT/update_NNNNNNN`` every ``--save-every`` updates and at the end, and a
run started with the same ``--ckpt`` resumes from the newest complete one (the same mesh; fewer or more hosts
load too). With GPUs each rank takes ``cuda:LOCAL_RANK`` and NCCL. Every update's loss goes to stdout
(rank 0) as ``update N loss X`` (``repr``: equal runs print equal digits).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))
from data import load_corpus, sample_batch  # noqa: E402

import acco.checkpoint  # noqa: E402
from acco import AccoOptimizer  # noqa: E402


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism wq/wk/wv return this rank's heads only: -1 is the local head count.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx) + self.pos_embeddings(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallelize(model: Decoder, mesh, plan_name: str = "projections") -> None:
    """Tensor parallelism on mesh['tp'], then FSDP2 on mesh['shard'] (each block, then the root), as
    torchtitan's parallelize does. ``plan_name``: "projections" (each block's projections only) or "torchtitan"
    (torchtitan's Llama plan: embeddings Rowwise into a sequence-sharded residual stream, SequenceParallel norms,
    PrepareModuleInput before attention and the feed-forward, and the output Colwise into vocabulary-sharded
    logits for loss parallelism)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if plan_name == "torchtitan":
        parallelize_module(model, mesh["tp"], {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (T, dim)
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })
        plan = {"attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])


def sharded_on_meta(make, mesh) -> Decoder:
    """``make()``'s model built on the meta device, FSDP2 on ``mesh`` (each block, then the root), then
    materialised and initialised: no rank ever holds the whole model (torchtitan's way; the benchmarks')."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = make()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2, help="hosts: ACCO's data-parallel dimension")
    p.add_argument("--shard", type=int, default=1, help="FSDP2 ranks per host")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per host")
    p.add_argument("--mode", default="acco", choices=["acco", "dpu", "sync"])
    p.add_argument("--plan", default="projections", choices=["projections", "torchtitan"],
                   help="the tensor-parallel plan: each block's projections, or torchtitan's Llama plan "
                        "(sequence-parallel norms, loss parallel)")
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per update on each rank")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--data", default=None, help="a text file or folder (default: the Python standard library)")
    p.add_argument("--ckpt", default=None, help="checkpoint folder: saved to, and resumed from if it holds one")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--stop-after", type=int, default=None, help="leave after this many updates (as a killed job)")
    args = p.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    if args.dp * args.shard * args.tp != world:
        raise SystemExit(f"--dp {args.dp} x --shard {args.shard} x --tp {args.tp} must equal the {world} ranks")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (args.dp, args.shard, args.tp), mesh_dim_names=("dp", "shard", "tp"))
    reader = mesh.get_local_rank("dp") * args.shard + mesh.get_local_rank("shard")  # tp ranks read alike

    train_bytes, _ = load_corpus(args.data)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Decoder(256, args.dim, args.layers, args.heads, args.seq_len).to(device)
    parallelize(model, mesh, args.plan)
    opt = AccoOptimizer(model.parameters(), torch.optim.AdamW, mode=args.mode,
                        microbatches_per_update=args.microbatches, process_group=mesh["dp"], lr=args.lr,
                        betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=args.max_grad_norm)

    start = 0
    latest = acco.checkpoint.latest(args.ckpt) if args.ckpt else None
    if latest:
        extra = acco.checkpoint.load(latest, opt, model=model, extra={"update": torch.zeros(1, dtype=torch.int64)})
        start = int(extra["update"])
        if dist.get_rank() == 0:
            print(f"resumed from {latest} at update {start}", flush=True)

    def save(update: int) -> None:
        acco.checkpoint.save(os.path.join(args.ckpt, f"update_{update:07d}"), opt, model=model,
                             extra={"update": torch.tensor([update])})

    end = args.updates if args.stop_after is None else min(args.updates, args.stop_after)
    t0 = time.perf_counter()
    for update in range(start, end):
        gen = torch.Generator().manual_seed(1000 * reader + update)  # the data position is the update number
        total = 0.0
        for _ in range(args.microbatches):
            x, y = sample_batch(train_bytes, args.batch, args.seq_len, gen)
            # torchtitan's plan: vocabulary-sharded logits (a DTensor), their cross-entropy under loss_parallel()
            with loss_parallel() if args.plan == "torchtitan" else contextlib.nullcontext():
                logits = model(x.to(device))
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
                (loss / args.microbatches).backward()
            value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            total += value.item() / args.microbatches
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"update {update + 1} loss {total!r}", flush=True)
        if args.ckpt and ((update + 1) % args.save_every == 0 or update + 1 == end):
            save(update + 1)
    opt.finish()
    if dist.get_rank() == 0:
        print(f"done: {end - start} updates in {time.perf_counter() - t0:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
