"""The README's own ```python blocks, executed as written on 2 gloo ranks (CPU).

Each block is extracted from README.md and run with ``exec`` verbatim, in a
fresh namespace on every rank, inside ``run_ranks`` (a timeout: a bug is a
failure, not a hang). The names a block uses without defining them are what a
reader's script would already have; the test provides them:

- ``model``: ``tinynet.TinyNet`` (59 parameters; the same on every rank);
- ``batches``: an endless iterator of this rank's micro-batches ``(x, y)``,
  ``y`` a fixed linear function of ``x`` (so the loss can go down);
- ``loss_fn(model, batch)``: the mean squared error;
- ``max_steps``: ``MAX_STEPS`` (101, so that ``step % 100 == 0`` evaluates
  after the first update and after the last);
- ``evaluate(model)``: records the held-out loss and the weights it was given.

Nothing in a block's text is edited. A block that creates an
``AccoOptimizer`` is then checked: it ran ``max_steps`` updates, the held-out
loss went down, the ranks ended with the same weights, and the model after the
block holds the committed weights the last ``evaluate`` saw (the README's
``finish()`` promise). The Trainer and accelerate recipes live in
docs/integrations.md and are run by tests/test_integrations.py.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from _dist import DEFAULT_TIMEOUT, run_ranks
from tinynet import flat, make_model

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
MAX_STEPS = 101


def python_blocks(text: str):
    """``(line number, code)`` of every fenced ```python block of ``text``."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.S | re.M)]


def _blocks():
    with open(README) as f:
        return python_blocks(f.read())


def _teacher() -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(123))


def _batches(rank: int, n: int = 8):
    w, i = _teacher(), 0
    while True:
        x = torch.randn(n, 5, generator=torch.Generator().manual_seed(1000 * rank + i + 1))
        yield x, x @ w
        i += 1


def _loss_fn(model, batch) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _run_block(rank: int, world_size: int, code: str) -> dict:
    from acco import AccoOptimizer

    held_out_x = torch.randn(64, 5, generator=torch.Generator().manual_seed(999))
    held_out = (held_out_x, held_out_x @ _teacher())
    evals = []

    def evaluate(model):
        with torch.no_grad():
            evals.append((_loss_fn(model, held_out).item(), flat(model).clone()))

    model = make_model(0)
    start = flat(model).clone()
    ns = {"__name__": "__readme__", "model": model, "batches": _batches(rank), "loss_fn": _loss_fn,
          "max_steps": MAX_STEPS, "evaluate": evaluate}
    exec(compile(code, "README.md", "exec"), ns)
    opts = [v for v in ns.values() if isinstance(v, AccoOptimizer)]
    out = {"optimizers": len(opts), "evals": [e[0] for e in evals], "eval_weights": [e[1] for e in evals],
           "start": start, "final": flat(model).clone()}
    if opts:
        with torch.no_grad():
            out["final_loss"] = _loss_fn(model, held_out).item()
        out["num_updates"] = opts[0].num_updates
    return out


def test_readme_has_a_python_example():
    """The README must show a runnable python example (this file runs it)."""
    blocks = _blocks()
    assert blocks, "README.md has no ```python block"
    assert any("AccoOptimizer(" in code for _, code in blocks), "no README python block builds an AccoOptimizer"


def test_python_blocks_extracted_exactly():
    """The extraction takes every python block, whole, and nothing else."""
    text = "intro\n```python\na = 1\n\nb = 2\n```\n```bash\nmake test\n```\n```python\nc = 3\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n\nb = 2\n"), (10, "c = 3\n")]


@pytest.mark.parametrize("line,code", [pytest.param(*b, id=f"line{b[0]}") for b in _blocks()])
def test_readme_python_block_runs(line, code):
    """Run a README python block verbatim on 2 gloo ranks; if it trains, check what the README promises."""
    try:
        results = run_ranks(_run_block, 2, code, timeout=DEFAULT_TIMEOUT)  # 180 s unless ACCO_TEST_TIMEOUT
    except (AssertionError, TimeoutError) as e:
        raise AssertionError(f"README.md's python block at line {line} failed:\n{e}") from None
    r0, r1 = results
    if not r0["optimizers"]:
        return
    for r in results:
        assert r["num_updates"] == MAX_STEPS, r["num_updates"]
        assert len(r["evals"]) >= 2, "evaluate() ran fewer than twice"
        assert not torch.equal(r["eval_weights"][0], r["start"]), "the first evaluation saw untrained weights"
        assert r["final_loss"] < 0.95 * r["evals"][0], (r["evals"], r["final_loss"])  # 1.604 -> 1.447 as written
        assert torch.equal(r["final"], r["eval_weights"][-1]), "after the block the model is not the committed weights"
    assert torch.equal(r0["final"], r1["final"]), "the ranks ended with different weights"
