"""The mutation check's cases (tests/mutations.py) still apply: each finds the one line it breaks.

CI does not run the mutations themselves (each runs tests with the library broken), so a refactor that rewrites
a mutated line would leave its mutation unable to break anything, silently: this catches that in CI.
"""

from __future__ import annotations

import os
import shlex

import pytest

import mutations

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_names_are_unique():
    names = [mutations.short_name(case) for case in mutations.cases]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("case", mutations.cases, ids=[mutations.short_name(c) for c in mutations.cases])
def test_each_mutation_finds_its_line_once_and_names_existing_tests(case):
    name, path, old, new, tests = case
    with open(os.path.join(ROOT, path)) as f:
        count = f.read().count(old)
    assert count == 1, f"{name}: its text occurs {count} times in {path}; re-anchor it on the code as it now reads"
    assert new != old, name
    files = [w.split("::")[0] for w in shlex.split(tests) if w.startswith("tests/")]
    assert files and all(os.path.exists(os.path.join(ROOT, f)) for f in files), (name, tests)
