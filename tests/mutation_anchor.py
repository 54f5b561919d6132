"""Where a mutation of ``tests/mutations.py`` applies: a function (by its qualified name, in whichever file of
``src/acco`` defines it) and the code it changes there, matched token by token.

Whitespace, line breaks and comments do not count, so moving a function to another module, re-indenting it,
re-wrapping a line or editing a comment leaves its mutations anchored; changing the code a mutation breaks (or
renaming its function) is what un-anchors it, and ``tests/test_mutations.py`` says so in CI.

A case's ``old`` text says how much it replaces:

* it begins with a line break: from the end of the code before it (the break and indentation included);
* it begins with indentation: from the start of its first line, and ``new`` is re-indented by as much as the
  function moved;
* it ends with a line break: to the end of its last line (a trailing comment included), so ``new=""`` deletes
  whole lines;
* otherwise, exactly the tokens matched.
"""

from __future__ import annotations

import ast
import functools
import io
import pathlib
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Dict, List, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "acco"
_SKIP = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


def _tokens(text: str) -> List[tokenize.TokenInfo]:
    """The code tokens of ``text`` (a file or a fragment of one: unclosed brackets and odd indentation allowed)."""
    out = []
    try:
        for t in tokenize.generate_tokens(io.StringIO(text).readline):
            if t.type not in _SKIP:
                out.append(t)
    except (tokenize.TokenError, IndentationError):
        pass
    return out


def _functions(tree: ast.AST) -> Dict[str, Tuple[int, int]]:
    """Every function and class of a module by its dotted name (``Runtime.on_grad_accumulated``), with its
    first and last line; the module itself as ``""``."""
    out = {"": (1, 10 ** 9)}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[name] = (first, child.end_lineno)
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


@functools.lru_cache(maxsize=None)
def _spans(path: pathlib.Path, mtime: int) -> Dict[str, Tuple[int, int]]:
    return _functions(ast.parse(path.read_text()))


@dataclass
class Anchor:
    path: pathlib.Path
    source: str
    start: int  # offsets into source: the span the mutation replaces
    end: int
    replacement: str

    def mutated(self) -> str:
        return self.source[: self.start] + self.replacement + self.source[self.end:]


def locate(where: str) -> List[Tuple[pathlib.Path, Tuple[int, int]]]:
    """The files and line spans of ``where``: ``"Qual.name"`` (searched in every file of ``src/acco``),
    ``"path.py::Qual.name"`` or ``"path.py"`` (the whole module), the path relative to the repository's root."""
    path, qual = where.split("::", 1) if "::" in where else (where, "") if where.endswith(".py") else ("", where)
    files = [ROOT / path] if path else sorted(SRC.rglob("*.py"))
    hits = []
    for f in files:
        spans = _spans(f, f.stat().st_mtime_ns)
        if qual in spans:
            hits.append((f, spans[qual]))
    return hits


def find(where: str, old: str, new: str) -> Anchor:
    """The one place ``old`` occurs in ``where`` (of the functions so named, the one whose code holds it);
    raises ``LookupError`` saying why there is not exactly one."""
    hits = locate(where)
    if not hits:
        raise LookupError(f"{where!r} names no function in src/acco")
    found, errors = [], []
    for path, (first, last) in hits:  # a name two modules define: the one whose code holds the mutation's
        try:
            found.append(anchor_in(path, path.read_text(), first, last, old, new, where))
        except LookupError as exc:
            errors.append(str(exc))
    if len(found) != 1:
        raise LookupError(errors[0] if len(hits) == 1 else
                          f"{where!r}: {len(found)} of the {len(hits)} functions of that name hold the mutation's "
                          f"code (want one; 'file.py::{where}' picks)")
    return found[0]


def anchor_in(path: pathlib.Path, source: str, first: int, last: int, old: str, new: str, where: str = "") -> Anchor:
    """``old`` in lines ``first``..``last`` of ``source`` (see the module docstring for the span it replaces)."""
    lines = source.splitlines(keepends=True)
    offset = [0]
    for line in lines:
        offset.append(offset[-1] + len(line))
    want = [(t.type, t.string) for t in _tokens(textwrap.dedent(old.strip("\n")))]
    toks = [t for t in _tokens(source) if first <= t.start[0] <= last]
    found = [i for i in range(len(toks) - len(want) + 1)
             if want and [(t.type, t.string) for t in toks[i:i + len(want)]] == want]
    if not found:  # inside one token (an f-string's text): the text itself, once in the function
        body = source[offset[first - 1]:offset[min(last, len(lines))]]
        if body.count(old) != 1:
            raise LookupError(f"{where}: the mutation's code occurs {body.count(old)} times there (want once)")
        start = offset[first - 1] + body.index(old)
        return Anchor(path, source, start, start + len(old), new)
    if len(found) != 1:
        raise LookupError(f"{where}: the mutation's code occurs {len(found)} times there (want once)")

    def at(pos: Tuple[int, int]) -> int:
        return offset[pos[0] - 1] + pos[1]

    head, tail = toks[found[0]], toks[found[0] + len(want) - 1]
    start, end, replacement = at(head.start), at(tail.end), new
    line_start = offset[head.start[0] - 1]
    if old.startswith("\n"):
        before = [t for t in _tokens(source) if t.end <= head.start]
        start = at(before[-1].end) if before else 0
    elif old[:1] in (" ", "\t") and not source[line_start:start].strip():  # whole lines, from their indentation
        start = line_start
        replacement = _reindent(new, old, lines[head.start[0] - 1])
    elif old[:1] in (" ", "\t"):  # a space before code in mid-line: keep it
        start -= len(old) - len(old.lstrip(" \t"))
    if old.endswith("\n"):
        end = offset[tail.end[0]]
    return Anchor(path, source, start, end, replacement)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _reindent(new: str, old: str, actual_first_line: str) -> str:
    """``new`` shifted by as much as the code moved: the first line of ``old`` against where it now is."""
    first_old = next((l for l in old.splitlines() if l.strip()), "")
    delta = _indent(actual_first_line) - _indent(first_old)
    if delta == 0:
        return new
    out = []
    for line in new.splitlines(keepends=True):
        if not line.strip():
            out.append(line)
        elif delta > 0:
            out.append(" " * delta + line)
        else:
            out.append(line[min(-delta, _indent(line)):])
    return "".join(out)
