"""The house holds together (docs/architecture.md): imports point down the layers, no module compares mode
strings but the modes module, and no module reads another's private members.

Read from the sources (``ast``), function-level imports included; nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "acco"

# docs/architecture.md's table, highest layer first.
LAYERS = {
    9: ["integrations.hf", "integrations.accelerate", "integrations.lightning", "integrations.torchtitan"],
    8: ["checkpoint", "probe"],
    7: ["optimizer"],
    6: ["runtime"],
    5: ["loops", "driver", "state.io", "state.target", "state.consolidated"],
    4: ["options", "buffers", "progress", "state.pieces", "state.legacy"],
    3: ["rounds", "_validation", "state.checksums", "policies", "state.residual", "compressed", "outer",
        "state.outer_state"],
    2: ["wrapped", "scheduler", "mesh", "grads", "session", "hooks", "state.format", "introspection",
        "integrations._given", "round_checks", "precision", "transport", "auto"],
    1: ["modes", "errors", "device_api", "placement", "arrivals", "functional", "snapshot", "collectives",
        "agreement", "amp", "ddp", "stats", "launch", "shard_buffers", "torch_hooks", "quantize"],
}
PACKAGES = {"acco": 10, "state": 0, "integrations": 10}  # the packages' __init__: re-exports (state's: nothing)


def _modules():
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)
        out[name or "acco"] = path
    return out


def _imports(name: str, path: pathlib.Path):
    """The acco modules ``name`` imports (relative imports, anywhere in the file)."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else ([] if name == "acco" else name.split("."))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:
                found.add(".".join(target + [alias.name]))
            if node.module:
                found.add(".".join(target))
    return found


def test_every_module_has_a_layer():
    placed = {m for ms in LAYERS.values() for m in ms}
    modules = set(_modules()) - set(PACKAGES)
    assert modules == placed, (sorted(modules - placed), sorted(placed - modules))


def test_imports_point_down_the_layers():
    layer = {m: n for n, ms in LAYERS.items() for m in ms}
    layer.update(PACKAGES)
    modules = _modules()
    up = []
    for name, path in modules.items():
        if name in PACKAGES:
            continue
        for target in _imports(name, path):
            if target in modules and target != name and layer[target] >= layer[name]:
                up.append(f"{name} (layer {layer[name]}) imports {target} (layer {layer[target]})")
    assert up == [], up


_MODE_STRING = re.compile(r"""(==|!=)\s*["'](acco|dpu|sync)["']|["'](acco|dpu|sync)["']\s*(==|!=)""")


@pytest.mark.parametrize("name", sorted(set(_modules()) - {"modes"}))
def test_no_mode_string_comparison_outside_the_modes_module(name):
    text = _modules()[name].read_text()
    assert not _MODE_STRING.search(text), f"{name}: compare a Mode (mode.estimates, ...), not its name"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_module_reads_another_acco_modules_private_names(name):
    """``from .x import _y`` and ``module._y`` of an acco module (``_validation``, ``_ddp`` are modules named so)."""
    modules = _modules()
    tree = ast.parse(modules[name].read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            bad += [f"from {'.' * node.level}{node.module or ''} import {a.name}" for a in node.names
                    if a.name.startswith("_") and a.name not in ("_validation",)]
    assert bad == [], bad


def test_rooms_stay_small():
    """No module of src/acco over 450 lines, no function over 60, AccoOptimizer.__init__ within 40 (issue 66)."""
    long_modules = [(p.name, n) for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450]
    long_functions, init = [], None
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long_functions.append((f"{path.relative_to(SRC)}:{node.name}", n))
                if path.name == "optimizer.py" and node.name == "__init__":
                    init = n
    assert long_modules == [] and long_functions == [], (long_modules, long_functions)
    assert init is not None and init <= 40, init
