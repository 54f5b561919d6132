"""Checks of user input, done once at construction: the parameters, their groups, the optimizer class and
its placement, the buffers (the options' checks are their policies', ``policies.py``). Each error says what
was received and what to do."""

from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable, List, Optional

import torch

from .state.format import IMPLEMENTATION_FLAGS
from .wrapped import class_defaults



def check_optimizer_class(optimizer_class: Any, where: str = "optimizer_class") -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"{where} must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
            f"(the class, not an instance), got {optimizer_class!r}"
        )


PLACEMENTS = ("elementwise", "whole")


def check_placement_option(placement: Any, assume_elementwise: Any) -> Optional[str]:
    """``placement=`` for optimizer classes acco does not know; ``assume_elementwise=True`` is ``"elementwise"``."""
    if not isinstance(assume_elementwise, bool):
        raise TypeError(f"assume_elementwise must be True or False, got {assume_elementwise!r}")
    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(
            f"placement must be None, 'elementwise' or 'whole' (how to shard an optimizer class acco does not "
            f"know), got {placement!r}"
        )
    if assume_elementwise and placement == "whole":
        raise ValueError("assume_elementwise=True and placement='whole' contradict each other: pass one of them")
    return "elementwise" if assume_elementwise else placement


def group_class(group: Dict[str, Any], index: int, default: type) -> type:
    """The optimizer class of param group ``index``: its ``"optimizer_class"``, else ``default``."""
    cls = group.get("optimizer_class", default)
    check_optimizer_class(cls, f"param group {index}'s 'optimizer_class'")
    return cls


def other_class_defaults(groups: List[Dict[str, Any]], classes: List[type], default: type) -> List[Dict[str, Any]]:
    """A group of another class than ``optimizer_class`` takes its class's defaults, not ``**optimizer_kwargs``
    (which are ``optimizer_class``'s): filled in before torch fills every group from the latter."""
    def own(cls: type) -> Dict[str, Any]:  # less the kernel flags: where a group gives none, none was chosen
        return {k: v for k, v in class_defaults(cls).items() if k not in IMPLEMENTATION_FLAGS}

    return [g if cls is default else {**own(cls), **g, "optimizer_class": cls} for g, cls in zip(groups, classes)]


def drop_foreign_defaults(groups: List[Dict[str, Any]], given: List[Iterable[str]], classes: List[type],
                          default: type, kwargs: Dict[str, Any]) -> None:
    """Remove from the groups of another class the keys torch filled in from ``**optimizer_kwargs`` that the
    class does not take (AdamW's ``betas`` in a Muon group), and the kernel flags (``foreach``, ...) that the
    group was not given: those chose ``optimizer_class``'s kernel, not this class's."""
    for g, keys, cls in zip(groups, given, classes):
        if cls is not default:
            own = class_defaults(cls)
            for key in kwargs:
                if key in g and (key not in own or (key in IMPLEMENTATION_FLAGS and key not in keys)):
                    del g[key]


def check_whole_tensors(cls: type, placement: str, params: List[torch.Tensor], first_index: int) -> None:
    """What a class placed whole refuses, checked on every rank before any rank builds it: Muon steps 2-D
    matrices only."""
    if getattr(torch.optim, "Muon", None) is not cls:
        return
    for k, p in enumerate(params):
        if p.dim() != 2:
            raise ValueError(
                f"parameter {first_index + k} {tuple(p.shape)} is in a torch.optim.Muon group, but Muon orthogonalises "
                "2-D matrices only. Give embeddings, the output head, norms and biases a param group of their own "
                "with an element-wise optimizer: AccoOptimizer([{'params': hidden_matrices, 'optimizer_class': "
                "torch.optim.Muon, 'lr': 0.02}, {'params': the_rest, 'lr': 3e-4}], torch.optim.AdamW, ...)"
            )


def check_fresh_optimizer(optimizer: Any, options: Dict[str, Any]) -> None:
    """``AccoOptimizer.from_optimizer``: a torch optimizer that has not stepped, and options that are ACCO's."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "AccoOptimizer.from_optimizer() takes a torch.optim.Optimizer instance (e.g. what "
            f"model.configure_optimizers(...) returns), got {torch.typename(optimizer)}"
        )
    if hasattr(optimizer, "layout") and hasattr(optimizer, "local_optimizers"):
        raise TypeError("AccoOptimizer.from_optimizer() got an AccoOptimizer: it is already one; use it as it is")
    if any(optimizer.state.values()):
        raise ValueError(
            f"AccoOptimizer.from_optimizer() got a {type(optimizer).__name__} that has already stepped: its state "
            "would be lost. Build the AccoOptimizer from a fresh optimizer, then resume from a checkpoint "
            "(opt.load_state_dict, acco.checkpoint.load, or opt.load_consolidated_state_dict for a plain "
            "optimizer's state dict)."
        )
    if "optimizer_class" in options or "params" in options:
        raise TypeError(
            "AccoOptimizer.from_optimizer(optimizer, **options): the parameters and optimizer_class come from "
            f"the optimizer; got {sorted(k for k in options if k in ('optimizer_class', 'params'))} as well"
        )


def prepare_groups(params: Any, optimizer_class: type) -> tuple:
    """The param groups for torch's ``Optimizer.__init__`` (each group's class's own defaults filled in where a
    group names another class), their classes, and each group's keys as given (before torch fills them)."""
    groups = normalize_param_groups(params)
    classes = [group_class(g, gi, optimizer_class) for gi, g in enumerate(groups)]
    groups = other_class_defaults(groups, classes, optimizer_class)
    return groups, classes, [set(g) for g in groups]


def from_optimizers(optimizer: Any, options: Dict[str, Any]) -> tuple:
    """``AccoOptimizer.from_optimizer``'s arguments: the groups of fresh torch optimizers (each with its class
    when there are several), the first one's class, and its constructor defaults under ``options``."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise ValueError("AccoOptimizer.from_optimizer() got an empty list: pass a torch optimizer, or several")
    for o in optimizers:
        check_fresh_optimizer(o, options)
    # torch's own kernel flags (fused=None, capturable=False, ...) are no choice: the device's default applies
    if len(optimizers) == 1:
        groups = [without_default_kernel_flags(g, type(optimizers[0])) for g in optimizers[0].param_groups]
    else:
        groups = [{**without_default_kernel_flags(g, type(o)), "optimizer_class": type(o)}
                  for o in optimizers for g in o.param_groups]
    first = optimizers[0]
    defaults = without_default_kernel_flags(constructor_defaults(first), type(first))
    return groups, type(first), {**defaults, **options}


def constructor_defaults(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's ``defaults`` its constructor accepts (torch's AdamW keeps ``decoupled_weight_decay``
    in ``defaults`` but does not take it as an argument)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def check_buffers(buffers: Any, device: torch.device) -> List[torch.Tensor]:
    """The model buffers to keep equal across ranks (``buffers=``)."""
    if buffers is None:
        return []
    if isinstance(buffers, torch.Tensor):
        raise TypeError("buffers must be an iterable of tensors such as model.buffers(), got a single Tensor")
    out = list(buffers)
    for i, b in enumerate(out):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"buffers[{i}] is a {type(b).__name__}; pass model.buffers()")
        if b.device != device:
            raise ValueError(f"buffers[{i}] is on {b.device} but the parameters are on {device}: move the model first")
    return out


def normalize_param_groups(params: Any) -> List[Dict[str, Any]]:
    """Turn ``params`` into a list of group dicts holding only trainable tensors.

    Parameters with ``requires_grad=False`` are dropped (frozen: never updated,
    never communicated).
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of Tensors or of param-group dicts (e.g. model.parameters()), "
            f"got a single {torch.typename(params)}"
        )
    try:
        items = list(params)
    except TypeError:
        raise TypeError(
            f"params must be an iterable of Tensors or of param-group dicts, got {torch.typename(params)}"
        ) from None
    if not items:
        raise ValueError("AccoOptimizer got an empty parameter list: pass model.parameters() of a model with parameters")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    out = []
    for gi, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TypeError(f"param group {gi} is a {type(group).__name__}; mix of dicts and tensors is not allowed")
        ps = group.get("params")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps or [])
        for pi, p in enumerate(ps):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param group {gi} holds a {torch.typename(p)}; expected torch.Tensor parameters")
            if not (p.is_floating_point() or p.is_complex()):
                raise TypeError(
                    f"parameter {pi} of group {gi} has dtype {p.dtype}; only floating-point parameters can be "
                    "trained: pass only the model's trainable parameters"
                )
        out.append({**group, "params": [p for p in ps if p.requires_grad]})
    if not any(g["params"] for g in out):
        raise ValueError(
            "AccoOptimizer found no parameter with requires_grad=True; parameters that do not require grad "
            "are ignored, so at least one trainable parameter is needed"
        )
    return out


def check_params(params: Iterable[torch.Tensor], compute_dtype: Optional[torch.dtype] = None) -> None:
    params = list(params)
    seen: Dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in seen:
            raise ValueError(
                f"parameter {i} {tuple(p.shape)} is also parameter {seen[id(p)]}: each parameter may appear once "
                "(in one param group); a duplicate would be updated and counted in the gradient norm twice"
            )
        seen[id(p)] = i
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"all parameters must be on one device, got {sorted(str(d) for d in devices)}: "
            "move the model with model.to(device) before building AccoOptimizer"
        )
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            "the parameters are on the meta device (no data): materialise the model first, e.g. "
            "model.to_empty(device=...) and its initialisation, then build AccoOptimizer"
        )
    dtypes = {p.dtype for p in params}
    for i, p in enumerate(params):
        if p.is_sparse or p.layout != torch.strided:
            raise TypeError(f"parameter {i} has layout {p.layout}; AccoOptimizer supports dense (strided) parameters only")
        if not p.is_floating_point():
            raise TypeError(f"parameter {i} has dtype {p.dtype}; only floating-point parameters can be trained (complex is not supported)")
    if len(dtypes) > 1:
        if compute_dtype is not None:  # compute_dtype casts one dtype to another; it does not merge several
            raise TypeError(
                f"all trainable parameters must share one dtype, got {sorted(str(d) for d in dtypes)} (with "
                f"compute_dtype={compute_dtype}, which casts a model of one dtype): cast the model to one dtype "
                "first (model.to(torch.float32)), then build AccoOptimizer"
            )
        raise TypeError(
            f"all trainable parameters must share one dtype, got {sorted(str(d) for d in dtypes)}: "
            "cast the model (model.to(dtype)) or pass compute_dtype=..."
        )


# Adam and AdamW on CUDA: the fused kernel unless the user chose a kernel. It keeps the step count on the
# device, skips a flagged step by itself (found_inf, so no snapshot to undo it), and holds the host for an
# eighth of the foreach kernels' time per update (docs/gpu.md, "Time per update").
FUSED_BY_DEFAULT = (torch.optim.Adam, torch.optim.AdamW)


def without_default_kernel_flags(options: Dict[str, Any], cls: type) -> Dict[str, Any]:
    """``options`` (a built optimizer's group or defaults) less the kernel flags (``IMPLEMENTATION_FLAGS``) at
    ``cls``'s constructor default: torch stores every flag in every group, so read off a built optimizer
    (``from_optimizer``, a Trainer's) a default value is no choice."""
    own = class_defaults(cls)
    return {k: v for k, v in options.items() if not (k in IMPLEMENTATION_FLAGS and k in own and v == own[k])}


def device_kernel(optimizer_class: type, chosen: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """The kernel flags to add to a param group of ``optimizer_class`` on ``device``, given the flags the group
    holds (``chosen``: the user's): on CUDA its step count on the device, Adam and AdamW as their fused kernel
    (``fused=True``), other classes ``capturable=True`` where they take it.

    The same update (to rounding); what changes is that a round undoes a step
    skipped for a non-finite gradient on the device, with no host
    synchronisation. ``fused=True``, ``capturable`` or ``differentiable=True``
    chosen: nothing added; ``fused=False`` or ``foreach`` chosen keep Adam and
    AdamW off the fused kernel (``capturable=True`` then). A class with neither
    option (Adagrad) decides a skip on the host, one sync per round.
    """
    if torch.device(device).type != "cuda":
        return {}
    if chosen.get("fused") or "capturable" in chosen or chosen.get("differentiable"):
        return {}
    if optimizer_class in FUSED_BY_DEFAULT and "fused" not in chosen and "foreach" not in chosen:
        return {"fused": True}
    return {"capturable": True} if "capturable" in class_defaults(optimizer_class) else {}
