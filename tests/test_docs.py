"""The README and the pages under docs/ link each other without a broken link.

Every relative Markdown link or image, ``[text](path)``, ``[text](path#anchor)`` or
``[text](#anchor)``, in README.md and docs/*.md must name a file that exists (inside
the repository), and its anchor, if any, a heading of the target Markdown file under
GitHub's rule (lowercase; punctuation other than hyphens, underscores and spaces
dropped; spaces to hyphens; a repeated heading gets ``-1``, ``-2``, ...). Links with a
scheme (``https://``, ``mailto:``) are not checked. Code blocks and inline code are
not Markdown, so links and headings inside them do not count.

The docs are one landing page and one page per concern: README.md must link to every
docs/*.md page, and every page must link back to README.md. Pure file reading, no
processes: this file runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:[ \t]+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def pages(root: Path = ROOT) -> list[Path]:
    """README.md, then every docs/*.md page."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def lines_outside_fences(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of every line of ``path`` outside fenced code blocks."""
    out, fence = [], ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~") and (not fence or marker == fence):
            fence = "" if fence else marker
            continue
        if not fence:
            out.append((number, line))
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    """Like :func:`lines_outside_fences`, with inline code blanked (a link in code is no link)."""
    return [(number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line))
            for number, line in lines_outside_fences(path)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: ``## Numerics: what a wire costs`` ->
    ``numerics-what-a-wire-costs``."""
    text = LINK.sub(lambda m: m.group("text"), heading)  # a link in a heading renders as its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of ``path``."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in lines_outside_fences(path):  # a heading's anchor keeps its code's text
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link and image in ``path``'s prose."""
    return [(number, m.group("target")) for number, line in prose(path) for m in LINK.finditer(line)]


def resolve(path: Path, target: str) -> tuple[Path | None, str]:
    """The file a relative link points at (``None`` for a same-page anchor) and its anchor."""
    file, _, anchor = target.partition("#")
    return ((path.parent / file).resolve() if file else None), anchor


def problems(root: Path = ROOT) -> list[str]:
    """One ``file:line: ...`` line per broken link in the README and docs pages."""
    out = []
    for path in pages(root):
        name = path.relative_to(root)
        for number, target in links(path):
            if SCHEME.match(target):
                continue
            file, anchor = resolve(path, target)
            where = f"{name}:{number}: [..]({target})"
            if file is not None:
                if root.resolve() not in (file, *file.parents):
                    out.append(f"{where}: points outside the repository")
                    continue
                if not file.exists():
                    out.append(f"{where}: {file.relative_to(root.resolve())} does not exist")
                    continue
            else:
                file = path.resolve()
            if anchor and file.suffix == ".md" and anchor not in anchors(file):
                out.append(f"{where}: {file.relative_to(root.resolve())} has no heading with anchor #{anchor}")
    return out


def linked_files(path: Path) -> set[Path]:
    """The files ``path`` links to (relative links only, anchors dropped)."""
    found = set()
    for _, target in links(path):
        if not SCHEME.match(target):
            file, _ = resolve(path, target)
            if file is not None:
                found.add(file)
    return found


# ============================================================== the checks

def test_every_link_and_anchor_resolves() -> None:
    bad = problems()
    assert not bad, "broken links in the README and docs:\n" + "\n".join(bad)


def test_the_readme_links_to_every_docs_page() -> None:
    linked = linked_files(README)
    missing = [p.relative_to(ROOT).as_posix() for p in pages()[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links to no {missing}: add each page to its Documentation list"


@pytest.mark.parametrize("page", [p.name for p in pages()[1:]])
def test_every_page_links_back_to_the_readme(page: str) -> None:
    path = ROOT / "docs" / page
    assert README.resolve() in linked_files(path), \
        f"docs/{page} has no link back to README.md (e.g. a first line '[fastreduce](../README.md) > ...')"


# ============================================================== the checker itself

def test_slug_follows_githubs_rule() -> None:
    assert slug("Local updates: LocalSGD, post-local and hierarchical averaging, DiLoCo") == \
        "local-updates-localsgd-post-local-and-hierarchical-averaging-diloco"
    assert slug("What fastreduce would do here: `fastreduce info`") == "what-fastreduce-would-do-here-fastreduce-info"
    assert slug("One communication layer; the shared-memory transport") == \
        "one-communication-layer-the-shared-memory-transport"
    assert slug("all_reduce_gradients (Join)") == "all_reduce_gradients-join"


def test_the_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n\n## Quick start\n\n[ok](docs/a.md#a-page) [gone](docs/nope.md) [anchor](docs/a.md#nope)\n"
        "[self](#quick-start) [self bad](#nowhere) [web](https://example.com/x.md) `[code](docs/nope.md)`\n"
        "```\n[in a block](docs/nope.md)\n# not a heading\n```\n[up](../outside.md)\n")
    (tmp_path / "docs" / "a.md").write_text("[fastreduce](../README.md) > A\n\n# A page\n\n## Twice\n\n## Twice\n"
                                           "\n[second](#twice-1) [image](pic.png)\n")
    (tmp_path / "docs" / "b.md").write_text("# Orphan\n")
    bad = problems(tmp_path)
    assert [b.split(": [..]")[0] for b in bad] == ["README.md:5", "README.md:5", "README.md:6", "README.md:11",
                                                  "docs/a.md:9"], bad
    assert "docs/nope.md does not exist" in bad[0] and "#nope" in bad[1] and "#nowhere" in bad[2]
    assert "outside the repository" in bad[3] and "docs/pic.png does not exist" in bad[4]
    readme_links = linked_files(tmp_path / "README.md")
    assert (tmp_path / "docs" / "a.md").resolve() in readme_links
    assert (tmp_path / "docs" / "b.md").resolve() not in readme_links
    assert (tmp_path / "README.md").resolve() in linked_files(tmp_path / "docs" / "a.md")

