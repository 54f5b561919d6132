"""The docs hold together: every relative link resolves, and the guides stay guides.

- Every relative Markdown link in README.md and docs/ (``[text](path)``,
  ``[text](path#anchor)``, ``![plot](file.png)``) names a file that exists,
  and an anchor names a heading of that file (GitHub's slugs), so moving a
  record to docs/studies/ cannot leave a dangling link behind.
- The README stays a front door (at most 150 lines) and each guide in docs/ at
  most 300 lines; records, run logs and generated blocks live in docs/studies/
  (issue #50). docs/algorithm.md is the contract, not a guide: it is exempt.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX, GUIDE_MAX = 150, 300
NOT_GUIDES = {"algorithm.md"}  # the math's contract: as long as the math needs

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def markdown_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation other than ``-`` and ``_`` dropped,
    spaces to ``-``."""
    text = re.sub(r"`|\*\*|\*|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    """Every heading's anchor in ``path``, numbered ``-1``, ``-2``, ... when repeated, as GitHub does."""
    seen: dict = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def links(path: Path):
    """``(line, target)`` of every link in ``path`` outside code blocks and inline code."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    for i, line in enumerate(text.splitlines(), 1):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            yield i, m.group(1)


def test_slugs_follow_github():
    assert slug("## 2. Overlap sweep (`benchmarks/overlap.py`)".lstrip("# ")) == "2-overlap-sweep-benchmarksoverlappy"
    assert slug("Will ACCO pay off on my cluster?") == "will-acco-pay-off-on-my-cluster"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"line {line}: {target} (no such file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"line {line}: {target} (no heading with anchor #{anchor} in {dest.name})")
    assert not bad, f"{path.relative_to(ROOT)} has links that do not resolve:\n" + "\n".join(bad)


def test_readme_is_a_front_door():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX, f"README.md has {n} lines (at most {README_MAX}): move detail to docs/ and link to it"


@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in NOT_GUIDES],
                         ids=lambda p: p.name)
def test_guides_stay_guides(path):
    n = len(path.read_text().splitlines())
    assert n <= GUIDE_MAX, (f"docs/{path.name} has {n} lines (a guide holds at most {GUIDE_MAX}): move records, run "
                            "logs and generated blocks to docs/studies/ and link to them")


def test_options_md_lists_every_argument_and_every_resolved_option():
    """docs/options.md has a row for each keyword of AccoOptimizer(...) and each field of Options, and each
    policy's table is the one its fields make (``python -m acco.options`` prints them)."""
    import inspect

    from acco import AccoOptimizer
    from acco.options import Options, markdown_table
    from acco.policies import POLICIES

    text = (ROOT / "docs" / "options.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    keywords = [n for n, p in inspect.signature(AccoOptimizer.__init__).parameters.items()
                if n not in ("self", "params") and p.kind is not inspect.Parameter.VAR_KEYWORD]
    missing = [n for n in keywords + Options.names() if not any(f"`{n}`" in row for row in rows)]
    assert missing == [], f"docs/options.md has no row for {missing}"
    for name in POLICIES:
        marker = f"<!-- policy {name}: made from acco.policies (python -m acco.options) -->\n"
        assert marker in text, f"docs/options.md lacks the {name} policy's table (its marker {marker!r})"
        table = text.split(marker, 1)[1].split("\n\n", 1)[0].strip()
        assert table == markdown_table(name), (
            f"docs/options.md's {name} table is not the one acco.policies makes: paste `python -m acco.options`")
