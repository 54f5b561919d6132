"""torch.optim.Optimizer's hooks and resume order, as on a plain optimizer (issue 65, findings 5 and 6).

One process, no process group: the hooks are the optimizer's, not the group's.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tinynet import loss_fn, make_model

from acco import AccoOptimizer

KW = dict(lr=1e-2, weight_decay=0.1)


def _train(opt, model, updates: int, m: int = 2) -> None:
    for t in range(updates):
        for j in range(m):
            (loss_fn(model, 0, t * m + j) / m).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", ["acco", "dpu", "sync"])
def test_global_step_hooks_fire_once_per_update_on_the_callers_thread(mode):
    """torch's global step hooks see the AccoOptimizer's step() only: once per update, on the thread that called
    it (never for the wrapped AdamW, whose step the round runs); the wrapped optimizer's own hooks still fire."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode=mode, microbatches_per_update=2, **KW)
    seen = []
    main = threading.get_ident()
    pre = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("pre", type(o).__name__, threading.get_ident())))
    post = register_optimizer_step_post_hook(lambda o, a, k: seen.append(("post", type(o).__name__, threading.get_ident())))
    local = []
    opt.local_optimizer.register_step_pre_hook(lambda o, a, k: local.append(o))
    try:
        _train(opt, model, 4)
        opt.finish()
    finally:
        pre.remove()
        post.remove()
    assert seen == [(kind, "AccoOptimizer", main) for _ in range(4) for kind in ("pre", "post")], seen
    assert len(local) == 4 and all(o is opt.local_optimizer for o in local), local  # one commit per update


def test_state_dict_hooks_run_as_on_a_torch_optimizer():
    """register_state_dict_pre_hook/_post_hook and register_load_state_dict_pre_hook/_post_hook: each called
    once per call, the post hook's dict returned, the load pre hook's dict loaded."""
    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", microbatches_per_update=2, **KW)
    _train(opt, model, 2)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd-pre", o)))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append(("sd-post", o)) or {**sd, "extra": 7})
    sd = opt.state_dict()
    assert sd["extra"] == 7
    assert calls == [("sd-pre", opt), ("sd-post", opt)]

    model2 = make_model()
    with torch.no_grad():
        for p, q in zip(model2.parameters(), model.parameters()):
            p.copy_(q)
    opt2 = AccoOptimizer(model2.parameters(), mode="sync", microbatches_per_update=2, **KW)
    loaded = []

    def drop_extra(o, state_dict):
        loaded.append(("load-pre", o, "extra" in state_dict))
        return {k: v for k, v in state_dict.items() if k != "extra"}

    opt2.register_load_state_dict_pre_hook(drop_extra)
    opt2.register_load_state_dict_post_hook(lambda o: loaded.append(("load-post", o, None)))
    opt2.load_state_dict(sd)
    assert loaded == [("load-pre", opt2, True), ("load-post", opt2, None)]
    assert opt2.num_updates == opt.num_updates == 2
    opt.finish()
    opt2.finish()


def test_scheduler_built_after_loading_state_resumes_like_adamw():
    """Load the state first, then build LambdaLR(opt, f, last_epoch=k), which plain AdamW allows: the groups
    get the saved initial_lr, and the schedule goes on from k as it does for AdamW."""
    f = lambda t: 1.0 / (1 + t)  # noqa: E731
    k = 3
    runs = {}
    for name in ("adamw", "acco"):
        model = make_model()
        make = (lambda ps: torch.optim.AdamW(ps, **KW)) if name == "adamw" else \
            (lambda ps: AccoOptimizer(ps, mode="sync", microbatches_per_update=2, **KW))
        opt = make(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
        for t in range(k):
            for j in range(2):
                (loss_fn(model, 0, 2 * t + j) / 2).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        sd = opt.state_dict()
        model2 = make_model()
        with torch.no_grad():
            for p, q in zip(model2.parameters(), model.parameters()):
                p.copy_(q)
        opt2 = make(model2.parameters())
        opt2.load_state_dict(sd)
        sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, f, last_epoch=k - 1)  # the order that used to raise
        lrs = [opt2.param_groups[0]["lr"]]
        for t in range(k, k + 2):
            for j in range(2):
                (loss_fn(model2, 0, 2 * t + j) / 2).backward()
            opt2.step()
            sched2.step()
            opt2.zero_grad()
            lrs.append(opt2.param_groups[0]["lr"])
        runs[name] = (opt2.param_groups[0]["initial_lr"], lrs)
        for o in (opt, opt2):
            if hasattr(o, "finish"):
                o.finish()
    assert runs["acco"] == runs["adamw"], runs
    assert runs["acco"][0] == KW["lr"]


def test_a_plain_optimizer_given_an_acco_state_dict_names_consolidated_state_dict(tmp_path):
    """In memory: torch's load_state_dict says what to do. Through torch.save / torch.load(weights_only=True)
    the state dict is a plain OrderedDict (nothing of acco is needed to read it back), and torch's KeyError is left."""
    import pickle

    model = make_model()
    opt = AccoOptimizer(model.parameters(), mode="sync", **KW)
    _train(opt, model, 2)
    sd = opt.state_dict()
    plain = torch.optim.AdamW(model.parameters(), **KW)
    with pytest.raises(KeyError, match=r"AccoOptimizer's state dict.*consolidated_state_dict\(\)"):
        plain.load_state_dict(sd)
    path = tmp_path / "opt.pt"
    torch.save(sd, path)
    back = torch.load(path, weights_only=True)
    from collections import OrderedDict

    assert type(back) is OrderedDict and type(pickle.loads(pickle.dumps(sd))) is OrderedDict
    assert back.keys() == sd.keys()
    with pytest.raises(KeyError, match="param_groups"):
        plain.load_state_dict(back)
    opt.load_state_dict(back)  # still an AccoOptimizer's to load
    plain.load_state_dict(opt.consolidated_state_dict())  # the fix the message names
    opt.finish()
