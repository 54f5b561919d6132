"""Run real torchtitan (0.3.0, torch 2.13) on CPU gloo ranks: the test scaffolding of issue 68.

    torchrun --nproc_per_node=4 tests/torchtitan_cpu.py --assets DIR -- --module llama3 --config llama3_debugmodel ...
    python tests/torchtitan_cpu.py --assets DIR --make-assets      # the tokenizer and the dataset, once

torchtitan 0.3.0 targets CUDA and a torch nightly. Seven things stop it on a CPU machine with stable torch 2.13;
each is worked around here, in the test scaffolding only (never in ``acco``), with the torchtitan line it
works around. Everything else (the config system, the model, its parallelize function, FSDP2, tensor
parallelism, the loss, the LR schedulers, the checkpointer) is torchtitan's own.

The assets stand in for the repository's ``tests/assets`` (not in the wheel): a byte-level BPE tokenizer of
2,048 tokens (the debug model's vocabulary) and a JSON-lines dataset of text, both from Python's standard
library sources (as ``examples/gpt/data.py``), so they are the same on every machine of one Python version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

import torch

VOCAB = 2048  # torchtitan.models.llama3 _debugmodel: vocab_size=2048


def make_assets(root: Path, documents: int = 400) -> None:
    """``root/tokenizer`` (tokenizer.json, tokenizer_config.json) and ``root/data/train.jsonl``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # transformers' dependency

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:documents]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    (root / "data").mkdir(parents=True, exist_ok=True)
    with open(root / "data" / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    with open(root / "tokenizer" / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": special[0], "eos_token": special[1], "add_bos_token": True,
                   "add_eos_token": True}, f)


def patch_for_cpu() -> None:
    """The seven CPU work-arounds. Call before torchtitan is imported."""
    import torch._utils

    # 1. torchtitan/tools/utils.py:55 `device_type = _get_available_device_type() or "cuda"`: with no device
    #    found it picks "cuda" at import time. Report "cpu" (device_module becomes torch.cpu).
    torch._utils._get_available_device_type = lambda: "cpu"

    # 7. torchtitan/distributed/minimal_async_ep/kernels.py:10 `import triton` (expert parallelism's triton
    #    kernels, imported by every model through models/common/token_dispatcher.py:17 and
    #    minimal_async_ep/api.py:30): triton ships with CUDA builds of torch only. A stand-in for that one
    #    module, whose kernels raise if called; the debug model never calls them, and torch's own checks for
    #    triton still find none.
    import types

    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def _no_triton(*args, **kwargs):
        raise RuntimeError("tests/torchtitan_cpu.py: expert parallelism's triton kernels do not run on CPU")

    kernels.__getattr__ = lambda name: _no_triton if name.endswith("_kernel") else (_ for _ in ()).throw(
        AttributeError(name))
    sys.modules[kernels.__name__] = kernels

    from torchtitan.components import metrics
    from torchtitan.distributed import fsdp as tt_fsdp
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention

    # 2. torchtitan/components/metrics.py:42-50 DeviceMemoryMonitor calls get_device_name,
    #    get_device_properties, reset_peak_memory_stats, empty_cache and memory_stats, which torch.cpu lacks.
    class CpuMemoryMonitor(metrics.DeviceMemoryMonitor):
        def __init__(self, device: str = "cpu") -> None:
            self.device, self.device_name, self.device_index = torch.device("cpu"), "cpu", 0
            self.device_capacity, self.device_capacity_gib = 1, 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.DeviceMemoryMonitor = CpuMemoryMonitor

    # 3. torchtitan/models/common/attention.py:359 FlexAttention.compiled_flex_attn: flex_attention has no
    #    CPU backward in torch 2.13 (and 0.3.0 refuses the "sdpa" backend for language models,
    #    models/common/config_utils.py:96). Same block-causal mask, materialized, through SDPA.
    def sdpa_on_the_mask(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        from torch.nn.attention.flex_attention import create_mask

        assert score_mod is None and not return_aux.lse, "the CPU stand-in covers the Llama debug model only"
        b, _, lq, _ = q.shape
        mask = create_mask(block_mask.mask_mod, b, None, lq, k.shape[2], device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, None

    attention.FlexAttention.compiled_flex_attn = staticmethod(sdpa_on_the_mask)

    # 4. torchtitan/distributed/fsdp.py:41 `set_gradient_divide_factor(1.0)`: FSDP2 then reduces with
    #    PREMUL_SUM, which gloo refuses. Sum instead (the divide factor is 1, so the same values).
    divide_off = tt_fsdp.disable_fsdp_gradient_division

    def divide_off_with_sums(model):
        divide_off(model)
        for module in model.modules():
            if isinstance(module, tt_fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = divide_off_with_sums

    # 5. torchtitan/distributed/utils.py:586 `barrier(device_ids=[device_module.current_device()])` fails on
    #    gloo, and 6. utils.py:595 `torch.distributed.set_timeout` does not exist in torch 2.13: after the
    #    first step, a plain barrier and the groups' timeouts left as they are.
    def set_pg_timeouts(timeout, parallel_dims) -> None:
        torch.distributed.barrier()

    dist_utils.set_pg_timeouts = set_pg_timeouts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--assets", type=Path, required=True)
    p.add_argument("--make-assets", action="store_true")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="after --: torchtitan's own arguments")
    args = p.parse_args(argv)
    if args.make_assets:
        make_assets(args.assets)
        return
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    patch_for_cpu()
    from torchtitan import train

    sys.argv = ["torchtitan.train", f"--hf_assets_path={args.assets / 'tokenizer'}",
                f"--dataloader.dataset_path={args.assets / 'data'}", *rest]
    train.main()


if __name__ == "__main__":
    main()
