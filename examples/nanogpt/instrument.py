"""Run a training script of this folder with the learning-rate study's instrumentation; the script is unchanged.

    torchrun --nproc_per_node=2 examples/nanogpt/instrument.py [--acco-option=KEY=VALUE ...] [--estimate-gap] \\
        examples/nanogpt/train_acco.py --out_dir=... [the script's --key=value settings]

* ``--acco-option=KEY=VALUE``: an extra ``AccoOptimizer`` keyword argument, an
  int, a float, a torch dtype, ``None`` or a word such as ``auto``, e.g. ``synchronous_updates=20`` (the study's
  remedy), ``compute_dtype=bfloat16``, ``reduce_dtype=float32``,
  ``estimate_dtype=None`` (the paper's exact estimate; the default is ``"auto"``)
  or ``estimate_extrapolation=1.2``;
* ``--ddp-hook=NAME``: a torch DDP communication hook registered on every
  ``DistributedDataParallel`` the script builds (``train_ddp.py``): ``powersgd``
  (torch's ``powerSGD_hook``: rank 4, error feedback, warm start, PowerSGD from
  the second all-reduce on, as ``benchmarks/worker.py``'s ``ddp-powersgd``;
  ``powersgd:RANK`` another rank) or
  ``fp16`` (``fp16_compress_hook``). The hook's state (PowerSGD's error and
  warm-start matrices) is not in the script's checkpoint: a resumed run starts
  it afresh;
* ``--regions-of-one``: every rank is a region of its own (``process_group``: a group of this rank alone) and
  ``outer_group`` is every rank, for the outer step of ``outer_every`` (``--acco-option=outer_every=30``: DiLoCo
  across the ranks, each running ACCO's rounds alone; ``docs/regions.md``); ``--regions=N``: ``N`` regions of
  consecutive ranks (``outer_group``: rank ``i`` of each). The loop's checkpoints
  (``acco.checkpoint.gather``, refused with ``outer_every``) hold nothing then: the study never resumes these runs;
* ``--estimate-gap``: after every ``step()``, rank 0 logs ``|theta~ - theta|``
  (what the model holds, in mode acco the estimate, against the committed
  update) and ``|theta_{t+1} - theta_t|`` to ``OUT_DIR/estimate_gap.json``.
  It waits for every commit: a diagnostic, not for timing.
* ``--estimate-blend=W``: a candidate remedy screened by the time-to-target
  study (``docs/studies/time-to-target.md``), not a library option. It changes the
  arithmetic of the estimate round's Adam step (``acco.functional._adam``,
  which computes ``Opt*`` only), never the commit: the estimate's gradient is
  ``W * g + (1 - W) * m`` (``m`` the first moment before the step: ``W = 0`` is
  the momentum-only prediction). Adam and AdamW only, on the path without a
  snapshot (fp32 master on the CPU); a run where the screen computed no
  estimate by its fourth ``step()`` stops. (The other screened candidate, the
  extrapolated estimate, is the library's ``estimate_extrapolation`` now.)

Both act through a subclass of ``AccoOptimizer`` put in place of the library's
before the script imports it; a script without ``AccoOptimizer`` (``train_ddp.py``)
runs as it is.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys

import torch

import acco


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in params])


SCREENED = [0]  # estimates computed by screen_estimate's arithmetic, in this process


def regions_of(n: int) -> dict:
    """``AccoOptimizer`` keywords that cut the world into ``n`` regions of consecutive ranks (``--regions=N``;
    ``--regions-of-one``: a region per rank), and the loop's checkpoints empty. Collective on WORLD (every rank
    makes every group)."""
    import torch.distributed as dist
    import acco.checkpoint

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % n:
        raise SystemExit(f"instrument.py: --regions={n} does not divide the {world} ranks")
    size = world // n
    regions = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(n)]
    across = [dist.new_group(list(range(i, world, size))) for i in range(size)]
    acco.checkpoint.gather = lambda optimizer, model=None, dst=0: {"model": {}, "optimizer": {}}
    return {"process_group": regions[rank // size], "outer_group": across[rank % size]}


def instrument(options: dict, estimate_gap: bool, out_dir: str, screening: bool = False,
               regions: int = 0) -> None:
    base = acco.AccoOptimizer
    rows: list = []

    class Instrumented(base):
        def __init__(self, *args, **kwargs):
            placed = regions_of(regions) if regions else {}
            super().__init__(*args, **{**kwargs, **options, **placed})
            self._study_params = [p for g in self.param_groups for p in g["params"]]
            self._study_previous = _flat(self._study_params) if estimate_gap else None

        def step(self, closure=None):
            loss = super().step(closure)
            self._study_steps = getattr(self, "_study_steps", 0) + 1
            # one round in flight at a time: this step's hand-off waited for the update's estimate round
            if screening and self._study_steps == 4 and SCREENED[0] == 0:
                raise RuntimeError("instrument.py: --estimate-blend changed no estimate "
                                   "(the optimizer does not take acco.functional's Adam path): nothing to screen")
            if estimate_gap and self.rank == 0:
                held = _flat(self._study_params)
                with self.committed_weights():
                    committed = _flat(self._study_params)
                rows.append({"estimate_gap": (held - committed).norm().item(),
                             "update_norm": (committed - self._study_previous).norm().item()})
                self._study_previous = committed
            return loss

    acco.AccoOptimizer = Instrumented
    if estimate_gap and int(os.environ.get("RANK", "0")) == 0:
        atexit.register(lambda: open(os.path.join(out_dir, "estimate_gap.json"), "w").write(json.dumps(rows)))


def register_ddp_hook(name: str) -> None:
    """Make every ``DistributedDataParallel`` built from now on register torch's hook ``name`` (the script imports
    the class after this runs, so it gets the subclass)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd  # noqa: PLC0415

    flag, (name, _, rank) = name, name.partition(":")
    if name not in ("powersgd", "fp16") or (rank and (name != "powersgd" or not rank.isdigit())):
        raise SystemExit(f"instrument.py: --ddp-hook={flag!r}: choose powersgd, powersgd:RANK or fp16")
    base = torch.nn.parallel.DistributedDataParallel

    class Hooked(base):
        def __init__(self, *args, **kwargs):
            # One bucket: PowerSGD chains each bucket's all-reduces through futures, and on gloo two buckets'
            # chains reach the collectives in different orders on the two ranks ("Received data size doesn't
            # match expected size", then an abort). The hook's arithmetic is per tensor, so the buckets do not
            # change the updates, only when they start.
            kwargs.setdefault("bucket_cap_mb", 1024)
            super().__init__(*args, **kwargs)
            if name == "fp16":
                self.register_comm_hook(None, default_hooks.fp16_compress_hook)
                return
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(rank or 4),
                                           start_powerSGD_iter=2,
                                           use_error_feedback=True, warm_start=True)
            self.register_comm_hook(state, powersgd.powerSGD_hook)

    torch.nn.parallel.DistributedDataParallel = Hooked


def screen_estimate(blend: float) -> None:
    """Put the study's candidate estimate in place of the library's Adam ``Opt*`` arithmetic (see the module's
    docstring); both ranks run this before the script starts, so their rounds agree."""
    from acco import functional  # noqa: PLC0415

    original = functional._adam

    def _adam(outs, params, grads, moments, scalars, g, *rest):
        SCREENED[0] += 1
        if moments is not None:  # before the first step there is no momentum to blend in
            grads = torch._foreach_add(torch._foreach_mul(grads, blend), moments[0], alpha=1.0 - blend)
        original(outs, params, grads, moments, scalars, g, *rest)  # outs = Opt*(theta, grads)

    functional._adam = _adam


def nice_in_own_session(autogroup: str = "/proc/self/autogroup") -> None:
    """Give this rank's scheduling group the niceness the study was started with (``nice -n 19``).

    On Linux with autogroup scheduling (``kernel.sched_autogroup_enabled``, on by default), the CPU is shared
    between sessions first and ``nice`` only orders the processes within one; torchrun starts each rank in a
    session of its own, so a niced study's ranks would take as much CPU as the tests or a benchmark beside them.
    Writing the niceness to the rank's autogroup makes ``nice`` count again; elsewhere this does nothing."""
    niceness = os.nice(0)
    if niceness > 0 and os.path.exists(autogroup):
        try:
            with open(autogroup, "w") as f:
                f.write(str(niceness))
        except OSError:  # not permitted here: the rank runs as it would have without this
            pass


def option_value(text: str):
    """``--acco-option``'s value: ``None``, a torch dtype's name, an int, a float, else the word itself
    (``estimate_extrapolation=auto``, ``estimate_dtype=auto``), which ``AccoOptimizer`` checks."""
    if text == "None":
        return None
    if isinstance(getattr(torch, text, None), torch.dtype):
        return getattr(torch, text)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def acco_option(flag: str):
    """``(key, value)`` of ``--acco-option=KEY=VALUE``. ``compression`` and ``estimate_compression`` name a
    format (``int8``, ``int4``), not torch's dtype of that name: the word as it is."""
    key, value = flag.split("=", 1)[1].split("=", 1)
    return key, value if key in ("compression", "estimate_compression", "outer_compression") else option_value(value)


def main(argv: list) -> None:
    nice_in_own_session()
    options, estimate_gap, regions = {}, False, 0
    blend, hook = 1.0, None
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--estimate-gap":
            estimate_gap = True
        elif flag == "--regions-of-one":
            regions = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
        elif flag.startswith("--regions="):
            regions = int(flag.split("=", 1)[1])
        elif flag.startswith("--estimate-blend="):
            blend = float(flag.split("=", 1)[1])
        elif flag.startswith("--ddp-hook="):
            hook = flag.split("=", 1)[1]
        elif flag.startswith("--acco-option="):
            key, value = acco_option(flag)
            options[key] = value
        else:
            raise SystemExit(f"instrument.py: unknown flag {flag!r} (see the docstring)")
    if not argv:
        raise SystemExit("instrument.py: name the training script to run")
    script = argv[0]
    out_dir = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--out_dir=")), ".")
    screening = blend != 1.0
    instrument(options, estimate_gap, out_dir, screening=screening, regions=regions)
    if hook is not None:
        register_ddp_hook(hook)
    if screening:
        screen_estimate(blend)
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
