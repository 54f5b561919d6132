"""torchtitan: ACCO as the optimizer across replicas (``dp_replicate``), FSDP2 and tensor parallelism inside.

One config change: the module that holds the config. Every torchtitan config function is found here by its
name and returned with ACCO in place of HSDP's replica all-reduce::

    torchrun --nproc_per_node=8 -m torchtitan.train --module acco.integrations.torchtitan --config llama3_8b \\
        --parallelism.data_parallel_replicate_degree 2 --parallelism.spmd_backend partial_dtensor \\
        --acco.mode acco --acco.estimate_dtype auto          # any field of AccoSettings, defaults as ACCO's

A config function of your own: ``return acco.integrations.torchtitan.with_acco(my_config())``.

What changes against torchtitan's HSDP, and why (``docs/integrations.md``, "torchtitan"):

* **The mesh.** torchtitan's own ``parallelize_fn`` runs, told that replication is off, so FSDP2 shards over
  ``dp_shard`` (``fsdp``) only and tensor parallelism goes where torchtitan puts it; FSDP2 is never handed the
  2-D HSDP mesh. ``AccoOptimizer`` then runs its rounds on the ``dp_replicate`` mesh (one replica: on each rank
  alone, so a run resumes on fewer replicas).
* **The gradient.** torchtitan divides each rank's loss by the global token count and sums across ranks
  (FSDP2's divide factor 1), so the rounds add the replicas' gradients (``divide_by_ranks=False``): the update
  is HSDP's. ``--training.global_batch_size`` sets the micro-batches per update (mode acco needs 2 or more).
* **Clipping.** ``--training.max_norm`` becomes ``max_grad_norm`` (the global norm of the summed gradient);
  torchtitan's own ``clip_grad_norm_`` on ``.grad`` (empty under ACCO) is not called, and the logged
  ``grad_norm`` is the norm of the last round ACCO collected (in mode acco, that update's estimate; the
  committed gradient's is one update behind).
* **Checkpoints.** torchtitan's checkpointer (DCP) saves the committed weights as the model and ACCO's state
  under FQN-free, per-shard keys (``optimizer.acco.<shard>.*``); a resume on the same mesh is bit-identical,
  and on another number of replicas (the same model shards) the state is resharded.
* **A model-only load** (a seed checkpoint, ``--checkpoint.initial_load_path``, HF weights) is taken as the
  starting weights (``take_model_weights()``: the optimizer was built before torchtitan loads).
* **Validation** sees the committed weights; the end of ``train()`` calls ``finish()``.
* **The loss.** A chunked loss (``ChunkedLossWrapper``, the default of torchtitan's configs) becomes its own
  loss function: it runs a backward per chunk inside the forward, which ACCO would count as micro-batches.
* **Regions** (``--acco.regions R --acco.outer_every H``, ``docs/regions.md``): the replicas in ``R`` consecutive
  blocks, ACCO's rounds inside each, an outer step across them every ``H`` updates (``--acco.outer_lr``,
  ``outer_momentum``, ``outer_compression``, ``outer_delay``). The gradient stays the region's mean (the summed
  gradient times ``R``: torchtitan normalizes over every region's tokens); checkpoints are taken where an undelayed
  outer round made the regions' weights one (``outer_delay`` 0, the interval and the steps multiples of ``H``),
  each region's optimizer state under its own name.
* **Refused at start**, with the reason: pipeline, context and expert parallelism, the full-DTensor and
  spmd_types backends, quantized linears (float8 all-gather), CPU offload, CUDA graphs, asynchronous
  checkpoints, optimizers other than Adam/AdamW, and ``fused_opt_states_bf16``.

Tried with torchtitan 0.3.0 on torch 2.13 (CPU gloo ranks, ``tests/test_torchtitan.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ..checkpoint import entry_name, read_target
from ..modes import Mode
from ..optimizer import AccoOptimizer
from ..state import io as state_io

try:
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.quantization.utils import has_quantization
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer
except ImportError as exc:
    if exc.name == "torchtitan":
        raise ImportError("acco.integrations.torchtitan needs torchtitan: pip install 'torchtitan==0.3.0' (the extra "
                          "'torch-acco[torchtitan]'; in acco's clone, pip install -e '.[torchtitan]')") from exc
    raise ImportError(f"acco.integrations.torchtitan: importing torchtitan failed: {exc}") from exc

__all__ = ["AccoOptimizersContainer", "AccoSettings", "AccoTrainer", "with_acco"]

_FACTORIES = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


@dataclass(kw_only=True, slots=True)
class AccoSettings:
    """ACCO's options in torchtitan's config (``--acco.<field>``); each is the ``AccoOptimizer`` keyword of the
    same name (``docs/options.md``). The rest come from torchtitan's own: ``max_grad_norm`` from
    ``training.max_norm``, the micro-batches per update from the global batch, the group from the mesh."""

    mode: str = "acco"
    """"acco" (the default), "dpu" or "sync" (ZeRO-1 across replicas, no overlap)."""
    estimate_dtype: str = "auto"
    """"auto", "none" (the paper's exact estimate) or a dtype name ("bfloat16")."""
    estimate_extrapolation: str = "auto"
    """"auto" or a number ("1.0": the paper's step)."""
    compression: str = "none"
    """"none", "int8", "fp8", "int4" or "auto" (chosen from the link): quantized rounds with error feedback
    (docs/compression.md)."""
    compression_block: int = 256
    synchronous_updates: int = 0
    nonfinite: str = "skip"
    regions: int = 1
    """The replicas in this many regions (consecutive blocks of ``dp_replicate``: the first node ranks are the first
    region): ACCO's rounds inside a region, an outer step across them every ``outer_every`` updates
    (docs/regions.md). Needs ``outer_every``."""
    outer_every: int = 0
    """Updates between outer rounds across regions (0: none)."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_compression: str = "none"
    outer_delay: int = 0

    def options(self) -> Dict[str, Any]:
        """The ``AccoOptimizer`` keywords these settings stand for (words turned into their values)."""
        dtype = {"none": None, "auto": "auto"}.get(self.estimate_dtype, getattr(torch, self.estimate_dtype, None))
        if dtype is not None and dtype != "auto" and not isinstance(dtype, torch.dtype):
            raise ValueError(f"--acco.estimate_dtype {self.estimate_dtype!r}: give auto, none or a torch dtype's "
                             "name (bfloat16, float32)")
        extrapolation = self.estimate_extrapolation
        outer = {} if self.outer_every <= 0 else dict(
            outer_every=self.outer_every, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
            outer_compression=None if self.outer_compression == "none" else self.outer_compression,
            outer_delay=self.outer_delay)
        return dict(mode=self.mode, estimate_dtype=dtype,
                    estimate_extrapolation=extrapolation if extrapolation == "auto" else float(extrapolation),
                    compression=None if self.compression == "none" else self.compression,
                    compression_block=self.compression_block, synchronous_updates=self.synchronous_updates,
                    nonfinite=self.nonfinite, **outer)


class AccoOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizers container holding one :class:`~acco.AccoOptimizer` over the model's parameter
    groups as torchtitan builds them (``param_groups`` patterns, ``fused``/``foreach``). Built empty by
    torchtitan; :meth:`start` builds the optimizer once the mesh is known (``AccoTrainer`` calls it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts: List[torch.nn.Module]) -> None:
        if len(model_parts) != 1:
            raise NotImplementedError(f"AccoOptimizersContainer: {len(model_parts)} model parts (pipeline "
                                      "parallelism); ACCO trains one model part per rank")
        impl = self._build_impl_kwargs(config)
        groups, _ = self._build_param_groups(model_parts[0], config.param_groups, impl)
        self._groups = [{**g, "optimizer_class": _FACTORIES[name]} for name, gs in groups.items() for g in gs]
        self.model_parts, self.optimizers = model_parts, []
        self.grad_norm = torch.zeros(())  # the trainer logs it: the last collected round's, filled by step()
        self.restored = False  # whether a checkpoint load gave the optimizer its state (else: the model alone)
        self._post_init([p for g in self._groups for p in g["params"]])  # torch's hooks (MoE's pre-step hook)

    @property
    def acco(self) -> AccoOptimizer:
        if not self.optimizers:
            raise RuntimeError("AccoOptimizersContainer: start() has not run (AccoTrainer builds the optimizer "
                               "once the mesh is known)")
        return self.optimizers[0]

    def start(self, *, process_group: Any, microbatches_per_update: int, max_grad_norm: Optional[float],
              settings: AccoSettings, outer_group: Any = None) -> None:
        """Build the optimizer. Collective on ``process_group`` (the replicas; with regions, the region's) and
        ``outer_group`` (the same replica of every region): construction agrees the options and the layout and
        broadcasts the first replica's weights."""
        first = self._groups[0]["optimizer_class"]
        opt = AccoOptimizer(self._groups, first, process_group=process_group, outer_group=outer_group,
                            microbatches_per_update=microbatches_per_update, max_grad_norm=max_grad_norm,
                            divide_by_ranks=False, **settings.options())
        self.optimizers = [opt]
        self.grad_norm = torch.zeros((), device=opt.device)

    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        if closure is not None:
            raise ValueError("AccoOptimizersContainer.step(): closures are not supported (as torchtitan's own)")
        self.acco.step()
        norm = self.acco.runtime.driver.last_grad_norm
        if norm is not None:
            self.grad_norm.copy_(norm.reshape(()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.acco.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """ACCO's state for DCP (new tensors: DCP loads into them in place), nested under :attr:`shard` as
        ``acco.checkpoint.save`` nests it (ranks of different shards or regions hold different tensors under the
        same piece keys). Local: waits for the in-flight round."""
        return {"acco": {self.shard: state_io.state_dict(self.acco.runtime.owners, sharded=True)}}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Checked before anything changes (the model, already loaded by DCP, must be the one saved with it)."""
        state_io.load_state_dict(self.acco.runtime.owners, state_dict["acco"][self.shard])
        self.restored = True

    @property
    def shard(self) -> str:
        """The name this rank's entries are nested under, as ``acco.checkpoint.save`` names them: its model
        shard (``"shard1"``), with regions its region's too (``"region1-shard0"``); ``"all"`` without either."""
        return entry_name(self.acco) or "all"


class _WithinReplicas:
    """torchtitan's ``ParallelDims`` as a parallelize function should see it under ACCO: replication off (FSDP2
    on the ``fsdp`` mesh alone), everything else as it is."""

    dp_replicate_enabled = False

    def __init__(self, dims: Any) -> None:
        self._dims = dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


def _within_replicas(parallelize_fn: Callable) -> Callable:
    @functools.wraps(parallelize_fn)
    def parallelize(model: torch.nn.Module, *, parallel_dims: Any, **kwargs: Any) -> torch.nn.Module:
        return parallelize_fn(model, parallel_dims=_WithinReplicas(parallel_dims), **kwargs)

    return parallelize


def _regions(replicas: Any, regions: int) -> tuple:
    """The ``dp_replicate`` mesh cut into ``regions`` consecutive blocks of replicas: the region's replicas (ACCO's
    rounds) and the same replica of every region (the outer round). Collective on the world (DeviceMesh's
    ``_unflatten``, as torchtitan's ParallelDims makes its meshes)."""
    size = replicas.size()
    mesh = replicas._unflatten(0, (regions, size // regions), ("acco_region", "acco_replica"))
    return mesh["acco_replica"], mesh["acco_region"]


def _check_regions(config: Any) -> List[str]:
    """Where torchtitan's checkpoints meet regions: every region must hold the same weights when one is saved (DCP
    keeps one copy of the model), which an undelayed outer round gives at every multiple of ``outer_every``."""
    s, ckpt = config.acco, config.checkpoint
    if (s.regions > 1) != (s.outer_every > 0):
        return [f"--acco.regions {s.regions} with --acco.outer_every {s.outer_every}: give both (regions 2 or "
                "more, outer_every >= 1) for an outer step across regions, or neither"]
    if s.regions <= 1:
        return []
    replicas = config.parallelism.data_parallel_replicate_degree
    if replicas < s.regions or replicas % s.regions:
        return [f"--acco.regions {s.regions} with {replicas} replica(s) (--parallelism.data_parallel_replicate_degree):"
                " give a degree that the regions divide"]
    every, steps = s.outer_every, config.training.steps
    first = getattr(ckpt, "enable_first_step_checkpoint", False) and every > 1
    if not ckpt.enable or getattr(ckpt, "load_only", False) or (
            s.outer_delay == 0 and ckpt.interval % every == 0 and steps % every == 0 and not first):
        return []
    return [f"torchtitan's checkpoints with --acco.regions (interval {ckpt.interval}, steps {steps}, outer_every "
            f"{every}, outer_delay {s.outer_delay}{', a first-step checkpoint' if first else ''}): the regions hold "
            "the same weights, which a checkpoint saves once, only right after an undelayed outer round: set "
            "--acco.outer_delay 0 and --checkpoint.interval and --training.steps to multiples of "
            "--acco.outer_every (and no --checkpoint.enable_first_step_checkpoint)"]


def check_supported(config: Any) -> None:
    """Refuse, before anything is built, what ACCO cannot run under torchtitan, with the reason and the fix."""
    par, training = config.parallelism, config.training
    refusals = [
        (par.pipeline_parallel_degree > 1, "pipeline parallelism (ACCO swaps the weights of one model part per "
         "update; torchtitan's schedules step the stages themselves): set --parallelism.pipeline_parallel_degree 1"),
        (par.context_parallel_degree > 1, "context parallelism (not tried with ACCO's micro-batch accounting): set "
         "--parallelism.context_parallel_degree 1"),
        (par.expert_parallel_degree > 1, "expert parallelism (its sparse mesh spans the replicas): set "
         "--parallelism.expert_parallel_degree 1"),
        (par.spmd_backend != "partial_dtensor", f"--parallelism.spmd_backend {par.spmd_backend} (FSDP2 there "
         "shards over the full data-parallel mesh, replicas included): use --parallelism.spmd_backend "
         "partial_dtensor"),
        (training.enable_cpu_offload, "FSDP2's CPU offload (ACCO's buffers are on the device): drop "
         "--training.enable_cpu_offload"),
        (not training.disable_cuda_graphs, "CUDA graphs (a captured backward replays without ACCO's hand-offs): "
         "set --training.disable_cuda_graphs"),
        (config.checkpoint.async_mode != "disabled", f"--checkpoint.async_mode {config.checkpoint.async_mode} "
         "(not tried: the save must see the committed weights while ACCO's round runs): use disabled"),
        (config.optimizer.implementation == "fused_opt_states_bf16", "--optimizer.implementation "
         "fused_opt_states_bf16 (its pre-step hook creates the state of a torch optimizer ACCO does not expose): "
         "use fused or foreach"),
        (config.model_spec is not None and has_quantization(config.model_spec.model), "quantized linears "
         "(float8/MXFP8/NVFP4: FSDP2's low-precision all-gather casts the shards ACCO swaps; not tried): train "
         "without the converters"),
    ]
    refusals.append((isinstance(config.loss, ChunkedLossWrapper.Config), "the chunked loss (ChunkedLossWrapper "
                     "runs a backward per chunk inside the forward, which ACCO would count as micro-batches): use "
                     "its loss_fn itself (with_acco does)"))
    names = sorted({g.optimizer_name for g in config.optimizer.param_groups} - set(_FACTORIES))
    refusals.append((bool(names), f"optimizer(s) {names} (ACCO wraps torch.optim ones here: Adam, AdamW)"))
    found = [why for bad, why in refusals if bad] + _check_regions(config)
    if found:
        raise NotImplementedError("acco.integrations.torchtitan does not support " + "; ".join(found))


class AccoTrainer(Trainer):
    """torchtitan's ``Trainer`` with an :class:`AccoOptimizersContainer` across replicas (the module docstring
    says what changes and why)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        acco: AccoSettings = field(default_factory=AccoSettings)

    def __init__(self, config: Config) -> None:
        check_supported(config)
        spec = config.model_spec
        config.model_spec = dataclasses.replace(
            spec, parallelize_fn=_within_replicas(spec.parallelize_fn),
            post_optimizer_build_fn=functools.partial(self._start_acco, spec.post_optimizer_build_fn))
        old = config.optimizer
        config.optimizer = AccoOptimizersContainer.Config(
            param_groups=old.param_groups, implementation=old.implementation,
            optimizer_factory_kwargs_by_name=old.optimizer_factory_kwargs_by_name)
        super().__init__(config)
        self._wrap_saves_and_validation()

    def _start_acco(self, model_post_build: Optional[Callable], optimizers: AccoOptimizersContainer,
                    model_parts: List[torch.nn.Module], parallel_dims: Any) -> None:
        """Runs where torchtitan calls the model's ``post_optimizer_build_fn``: the mesh and the micro-batches per
        update are known, the LR schedulers not yet built."""
        m = self.gradient_accumulation_steps
        if Mode.parse(self.config.acco.mode).estimates and m < 2:
            raise ValueError(
                f"acco.integrations.torchtitan: mode acco needs 2 or more micro-batches per update, got {m} "
                "(--training.global_batch_size is local_batch_size x data-parallel degree): set "
                "--training.global_batch_size to twice that, or --acco.mode dpu/sync")
        settings, outer_group = self.config.acco, None
        if parallel_dims.dp_replicate_enabled:
            group = parallel_dims.get_mesh("dp_replicate")
            if settings.regions > 1:  # the degree divides into them (check_supported)
                group, outer_group = _regions(group, settings.regions)
        else:  # one replica: ACCO on this rank alone (the default group, the world, would span FSDP2's mesh)
            # Collective on the world (every rank builds every one-rank group): torch's new_subgroups.
            group, _ = torch.distributed.new_subgroups(group_size=1)
        max_norm = self.config.training.max_norm
        optimizers.start(process_group=group, microbatches_per_update=m, max_grad_norm=max_norm if max_norm > 0 else None,
                         settings=settings, outer_group=outer_group)
        if model_post_build is not None:
            model_post_build(optimizers, model_parts, parallel_dims)

    def _wrap_saves_and_validation(self) -> None:
        opt, container = self.optimizers.acco, self.optimizers
        checkpointer, save, load = self.checkpointer, self.checkpointer.save, self.checkpointer.load
        dcp_load = getattr(checkpointer, "dcp_load", None)

        def complete_dcp_load(states: Dict[str, Any], checkpoint_id: str, **kwargs: Any) -> Any:
            # torchtitan's checkpointer asks the container for the state dict to load into; a fresh optimizer's
            # lacks the wrapped optimizer's state (torchtitan's own container makes it with an empty step). The
            # complete target is read from the checkpoint instead, loaded with the model, then restored.
            if "optimizer" not in states or kwargs.get("from_hf"):
                return dcp_load(states, checkpoint_id=checkpoint_id, **kwargs)
            target = {"acco": {container.shard: read_target(checkpoint_id, opt, ("optimizer", "acco",
                                                                                  container.shard))}}
            out = dcp_load({**states, "optimizer": target}, checkpoint_id=checkpoint_id, **kwargs)
            container.load_state_dict(target)
            return out

        if dcp_load is not None:
            checkpointer.dcp_load = complete_dcp_load

        def load_then_take(*args: Any, **kwargs: Any) -> Any:
            container.restored = False
            loaded = load(*args, **kwargs)
            if loaded and not container.restored:  # the model alone (a seed, initial or HF checkpoint)
                opt.take_model_weights()
            return loaded

        checkpointer.load = load_then_take

        def committed_save(curr_step: int, last_step: bool = False) -> Any:
            saving = getattr(checkpointer, "enable", False) and checkpointer._should_save(curr_step, last_step)
            with opt.committed_weights() if saving else contextlib.nullcontext():
                return save(curr_step, last_step=last_step)

        checkpointer.save = committed_save
        if self.config.validator.enable:
            validate = self.validator.validate

            def committed_validate(*args: Any, **kwargs: Any) -> Any:
                with opt.committed_weights():
                    return validate(*args, **kwargs)

            self.validator.validate = committed_validate

    def train_step(self, data_iterator: Any) -> None:
        # torchtitan clips .grad before step() (trainer.py, train_step); under ACCO the gradient is in ACCO's
        # buffers and clipped there (max_grad_norm): the call returns ACCO's norm for the log instead
        clip, dist_utils.clip_grad_norm_ = dist_utils.clip_grad_norm_, lambda *a, **k: self.optimizers.grad_norm
        try:
            super().train_step(data_iterator)
        finally:
            dist_utils.clip_grad_norm_ = clip

    def train(self) -> None:
        super().train()
        self.optimizers.acco.finish()  # the model holds the last committed weights


def with_acco(config: Any) -> AccoTrainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``) as an :class:`AccoTrainer` config, with CUDA graphs off
    (ACCO's hand-offs run in backward) and a chunked loss replaced by its own loss function (the same loss with
    the logits materialized: ``ChunkedLossWrapper`` runs a backward per chunk inside the forward, which ACCO
    would count as micro-batches)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out = AccoTrainer.Config(**values)
    out.training.disable_cuda_graphs = True
    if isinstance(out.loss, ChunkedLossWrapper.Config):
        out.loss = out.loss.loss_fn
    return out


def __getattr__(name: str) -> Callable[[], AccoTrainer.Config]:
    """``--module acco.integrations.torchtitan --config NAME``: torchtitan's config function ``NAME`` (searched in
    ``torchtitan.models.*.config_registry``), with ACCO."""
    if name.startswith("_"):
        raise AttributeError(name)
    from torchtitan.models import _supported_models

    for model in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            return functools.wraps(fn)(lambda: with_acco(fn()))
    raise AttributeError(f"acco.integrations.torchtitan: no torchtitan config function {name!r} in "
                         f"torchtitan.models.*.config_registry ({', '.join(sorted(_supported_models))})")
