"""Every relative link in the README and `docs/*.md` resolves (issue 26, item 7): the file exists,
and a `#fragment` names a heading (GitHub's anchor for it) or an explicit `id`/`name` in the page
it points to. Links inside code blocks and code spans are not links. The README is a front page:
at most 250 lines, and it links every page in `docs/`."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
HTML_ID = re.compile(r"""<[^>]+\s(?:id|name)=["']([^"']+)["']""")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:
FRONT_PAGE_LINES = 250


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """`text` without fenced code blocks and code spans."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    return INLINE.findall(body) + REFERENCE.findall(body)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text without markup, lowercased, punctuation but `-` and
    `_` dropped, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>|[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The fragments that `text` (a Markdown page) answers to; a repeated heading's later anchors
    end in `-1`, `-2`..."""
    found: set[str] = set(HTML_ID.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken(page: Path, text: str) -> list[str]:
    """The links in `text` (the page at `page`) that do not resolve, each with why."""
    bad = []
    for target in links(text):
        if EXTERNAL.match(target):
            continue
        path_part, _, fragment = target.partition("#")
        path = (page.parent / unquote(path_part)).resolve() if path_part else page
        if path_part and not path.exists():
            bad.append(f"{target} (no file {shown(path)})")
            continue
        known = anchors(path.read_text() if path_part else text) if path.suffix == ".md" else None
        if fragment and known is not None and unquote(fragment).lower() not in known:
            bad.append(f"{target} (no heading #{fragment} in {shown(path)})")
    return bad


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    texts = {page: page.read_text() for page in pages()}
    assert sum(len(links(text)) for text in texts.values()) >= 10, "the link pattern finds no links"
    bad = [f"{shown(page)}: {why}" for page, text in texts.items() for why in broken(page, text)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Set up (once)\n\n## Set up (once)\n")
    page = tmp_path / "page.md"
    text = (
        "# Title\n\n## `make run` does this\n\n"
        "[ok](other.md) [ok](other.md#set-up-once-1) [ok](#make-run-does-this) [ok](#title)"
        " [ok](https://example.com/x.md) ![ok](other.md)\n"
        "[gone](missing.md) [gone](other.md#nowhere) [gone](#set-up-once)\n"
        "`[code](missing.md)`\n\n```\n[code](missing.md)\n```\n\n[ref]: other.md#other-page\n"
    )
    assert [why.split(" (")[0] for why in broken(page, text)] == [
        "missing.md",
        "other.md#nowhere",
        "#set-up-once",
    ]


def front_page_problems(readme: Path, docs: list[Path]) -> list[str]:
    """Why `readme` is not a front page: longer than FRONT_PAGE_LINES, or a page of `docs` it
    does not link."""
    text = readme.read_text()
    problems = []
    if (n := len(text.splitlines())) > FRONT_PAGE_LINES:
        problems.append(f"{shown(readme)} is {n} lines (at most {FRONT_PAGE_LINES})")
    linked = {
        (readme.parent / unquote(target.partition("#")[0])).resolve()
        for target in links(text)
        if not EXTERNAL.match(target) and target.partition("#")[0]
    }
    problems += [
        f"{shown(readme)} does not link {shown(page)}" for page in docs if page.resolve() not in linked
    ]
    return problems


def test_the_readme_is_a_front_page_that_links_every_doc() -> None:
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert len(docs) >= 8, "docs/*.md finds no pages"
    assert front_page_problems(ROOT / "README.md", docs) == []


def test_a_long_readme_or_an_unlinked_doc_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    linked, unlinked, anchored = (tmp_path / "docs" / name for name in ("a.md", "b.md", "c.md"))
    for page in (linked, unlinked, anchored):
        page.write_text("# Page\n")
    readme = tmp_path / "README.md"
    body = "[a](docs/a.md) [c](docs/c.md#page) `[b](docs/b.md)`\n"
    readme.write_text(body + "line\n" * (FRONT_PAGE_LINES - 1))
    assert front_page_problems(readme, [linked, unlinked, anchored]) == [f"{readme} does not link {unlinked}"]
    readme.write_text(body + "line\n" * FRONT_PAGE_LINES)
    assert front_page_problems(readme, [linked, anchored]) == [
        f"{readme} is {FRONT_PAGE_LINES + 1} lines (at most {FRONT_PAGE_LINES})"
    ]
