"""Every relative link in the repository's Markdown resolves, inside the repository.

A reader of a fresh clone follows each ``[text](path)``, ``![alt](path)``, ``[ref]: path``
and ``(path#anchor)`` of every ``*.md`` file; each must name a file of the repository (and
an anchor, a heading of that file). A document that *names* another one as a path in code
(`` `../shared/DESIGN.md` ``) is a link too: it must resolve, from the document or from
the repository root. Issue 28: README.md and ARCHITECTURE.md sent readers to
``../shared/DESIGN.md``, a file outside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Folders that hold no documentation of the project: tools' state (any hidden folder too),
# build and run outputs.
SKIP_DIRS = {"venv", "node_modules", "build", "dist", "bench-out", "demo-store"}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
CODE_SPAN = re.compile(r"`([^`\s]+\.md(?:#[^`\s]*)?)`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def markdown_files() -> list[Path]:
    """Every ``*.md`` of the repository outside tool, build and output folders."""
    found = []
    for path in sorted(ROOT.rglob("*.md")):
        parts = path.relative_to(ROOT).parts
        folders = parts[:-1]
        if not any(f in SKIP_DIRS or f.startswith(".") or f.endswith(".egg-info") for f in folders):
            found.append(path)
    return found


def _prose(text: str) -> str:
    """The text without fenced code blocks (a link in a code sample is not followed)."""
    return FENCE.sub("", text)


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("//")


def links(path: Path) -> list[str]:
    """The relative link targets of one Markdown file (anchors within it included)."""
    text = _prose(path.read_text(encoding="utf-8"))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t for t in targets if _is_relative(t)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (repeats get ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(_prose(path.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _problem(doc: Path, target: str, *, from_root_too: bool = False) -> str | None:
    """Why ``target`` (as written in ``doc``) does not resolve, or None when it does."""
    file_part, _, anchor = target.partition("#")
    where = f"{doc.relative_to(ROOT)}: {target!r}"
    if file_part:
        bases = [doc.parent, ROOT] if from_root_too else [doc.parent]
        candidates = [(base / file_part).resolve() for base in bases]
        existing = [c for c in candidates if c.exists()]
        if not existing:
            return f"{where} names a file that does not exist"
        resolved = existing[0]
        if not resolved.is_relative_to(ROOT):
            return f"{where} points outside the repository"
    else:
        resolved = doc
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{where}: no heading of {resolved.relative_to(ROOT)} has the anchor #{anchor}"
    return None


DOCS = markdown_files()


def test_the_repository_has_its_docs() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "ARCHITECTURE.md", "docs/DESIGN.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc: Path) -> None:
    problems = [p for t in links(doc) if (p := _problem(doc, t))]
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_document_named_in_code_exists(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    named = CODE_SPAN.findall(_prose(text))
    problems = [p for t in named if (p := _problem(doc, t, from_root_too=True))]
    assert not problems, "documents named that are not in the repository:\n" + "\n".join(problems)


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    """The parser finds each link form (guards the test above against matching nothing)."""
    doc = tmp_path / "x.md"
    doc.write_text(
        '# Top\nSee [a](a.md), ![img](pics/p.png "t"), [sec](#top), [gone](#nope),\n'
        "[web](https://example.com) and\n\n[ref]: b.md#part\n\n```\n[not](followed.md)\n```\n",
        encoding="utf-8",
    )
    assert links(doc) == ["a.md", "pics/p.png", "#top", "#nope", "b.md#part"]
    assert anchors(doc) == {"top"}
    assert slug("Resume a training state (restore + the first optimizer step)") == (
        "resume-a-training-state-restore--the-first-optimizer-step"
    )
