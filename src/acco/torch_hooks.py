"""torch.optim.Optimizer's state-dict hooks, run around AccoOptimizer's own state dict as torch runs them.

``register_state_dict_pre_hook``/``_post_hook`` and ``register_load_state_dict_pre_hook``/``_post_hook`` fill
dicts on the optimizer (torch's); these run them in torch's order, with torch's rules (a post-hook's or a load
pre-hook's return value replaces the state dict).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

__all__ = ["load_with_hooks", "state_dict_with_hooks"]


def state_dict_with_hooks(opt: Any, make: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``make()`` between the optimizer's state-dict pre-hooks and post-hooks."""
    for pre_hook in list(opt._optimizer_state_dict_pre_hooks.values()):
        pre_hook(opt)
    state_dict = make()
    for post_hook in list(opt._optimizer_state_dict_post_hooks.values()):
        result = post_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load_with_hooks(opt: Any, state_dict: Any, load: Callable[[Any], None]) -> None:
    """``load(state_dict)`` between the optimizer's load-state-dict pre-hooks and post-hooks."""
    if isinstance(state_dict, dict):
        state_dict = dict(state_dict)  # shallow copy, as torch's load does, so a pre-hook may edit it
    for pre_hook in list(opt._optimizer_load_state_dict_pre_hooks.values()):
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for post_hook in list(opt._optimizer_load_state_dict_post_hooks.values()):
        post_hook(opt)
