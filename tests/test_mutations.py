"""The mutation check's cases (tests/mutations.py) still apply: each finds, in its function, the one piece of
code it breaks, and its mutation changes the code (not only its layout or comments) and still parses.

CI runs the mutations of the files a change touches (``make mutations``); this catches, for every case, a
refactor that rewrote the code a mutation breaks, which would leave it unable to break anything, silently.
"""

from __future__ import annotations

import ast
import os
import shlex

import pytest

import mutation_anchor
import mutations

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_names_are_unique():
    names = [mutations.short_name(case) for case in mutations.cases]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("case", mutations.cases, ids=[mutations.short_name(c) for c in mutations.cases])
def test_each_mutation_finds_its_line_once_and_names_existing_tests(case):
    name, where, old, new, tests = case
    try:
        anchor = mutation_anchor.find(where, old, new)
    except LookupError as exc:
        pytest.fail(f"{name}: {exc}; re-anchor it on the code as it now reads")
    mutated = anchor.mutated()
    assert ast.dump(ast.parse(mutated)) != ast.dump(ast.parse(anchor.source)), f"{name}: changes no code"
    files = [w.split("::")[0] for w in shlex.split(tests) if w.startswith("tests/")]
    assert files and all(os.path.exists(os.path.join(ROOT, f)) for f in files), (name, tests)


def test_an_anchor_follows_its_code_when_it_moves_is_rewrapped_or_recommented():
    """A mutation anchored on a function still lands when the function is moved into a class (re-indented), its
    line is wrapped differently and its comment rewritten; and it names what it cannot find."""
    old, new = "        if x > limit:  # too far\n            return None\n", "        if False:\n            return None\n"
    before = "def clip(x, limit):\n    for _ in range(1):\n        if x > limit:  # too far\n            return None\n    return x\n"
    after = ("class Box:\n    def clip(self, x,\n             limit):\n        for _ in range(1):\n"
             "            if x > \\\n                    limit:  # beyond the bound\n                return None\n"
             "        return x\n")
    for source, first in ((before, 1), (after, 2)):
        a = mutation_anchor.anchor_in(None, source, first, source.count("\n"), old, new)
        code = a.mutated()
        ns = {}
        exec(code, ns)
        clip = ns["clip"] if "clip" in ns else ns["Box"]().clip
        assert clip(5, 1) == 5, code  # the mutation took effect: no early return
        assert "if False:" in code and "limit" not in code.split("if False:")[1].split("return")[0], code
    with pytest.raises(LookupError, match="occurs 0 times"):
        mutation_anchor.anchor_in(None, before, 1, 5, "if x < limit:", "if False:")
