"""The documentation stays findable: no page over 25,000 bytes (README.md over 13,000), and every relative link
`[text](path)` or `[text](path#anchor)` in README.md, CHANGELOG.md, docs/*.md, tools/README.md and tests/README.md
reaches an existing file and, with an anchor, a heading of that file whose GitHub slug is the anchor."""

from __future__ import annotations

import re
from pathlib import Path

from tests.paths import REPO

PAGE_LIMIT = 25_000
README_LIMIT = 13_000
FENCE = re.compile(r"^ {0,3}(```|~~~)")
LINK = re.compile(r"(?<!\\)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]*)\)")


def pages() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md", REPO / "CHANGELOG.md"]


def linking_pages() -> list[Path]:
    return pages() + [REPO / "tools" / "README.md", REPO / "tests" / "README.md"]


def without_fences(markdown: str) -> str:
    """`markdown` with the lines of its fenced code blocks blanked (kept as empty lines, so line numbers hold)."""
    kept, fence = [], None
    for line in markdown.split("\n"):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            kept.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            kept.append("")
        else:
            kept.append(line)
    return "\n".join(kept)


def prose(markdown: str) -> str:
    """`markdown` without its fenced code blocks and inline code spans: the text whose links a reader follows."""
    return re.sub(r"(`+)[^`](?:(?!\n\s*\n).)*?\1", "", without_fences(markdown), flags=re.S)   # not past a paragraph


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text (markdown links, code marks and emphasis gone)
    lowercased, every character but letters, digits, '_', '-' and spaces dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"<[^>]*>", "", text)
    text = re.sub(r"[`*]", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a page's ATX headings, with GitHub's -1, -2, ... for repeated ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in without_fences(markdown).split("\n"):
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(markdown: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link outside code; a link's text may run over a line break."""
    text = prose(markdown)
    return [(text.count("\n", 0, match.start()) + 1, match.group(2)) for match in LINK.finditer(text)]


def broken_links(page: Path) -> list[str]:
    problems = []
    for number, target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or not target:   # http(s), mailto, ...
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO).as_posix()}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor and destination.is_file() and destination.suffix == ".md":
            if anchor not in anchors(destination.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading with that anchor")
        elif anchor and not destination.is_file():
            problems.append(f"{where}: an anchor into a directory")
    return problems


def test_no_page_is_over_the_limit():
    sizes = {page: page.stat().st_size for page in pages()}
    limits = {page: README_LIMIT if page.name == "README.md" and page.parent == REPO else PAGE_LIMIT for page in sizes}
    over = [f"{page.relative_to(REPO).as_posix()}: {size:,} bytes (limit {limits[page]:,})"
            for page, size in sizes.items() if size > limits[page]]
    assert not over, "split these pages by topic:\n" + "\n".join(over)


def test_every_relative_link_reaches_a_file_and_a_heading():
    for page in linking_pages():
        assert page.is_file(), page
    problems = [problem for page in linking_pages() for problem in broken_links(page)]
    assert not problems, f"{len(problems)} broken links:\n" + "\n".join(problems)


def test_slugs_are_githubs():
    assert slug("Streaming (100B words)") == "streaming-100b-words"
    assert slug("Memory (App. D)") == "memory-app-d"
    assert slug("Several processes, expert parallelism, ZeRO") == "several-processes-expert-parallelism-zero"
    assert slug("Against the paper's K40 clusters") == "against-the-papers-k40-clusters"
    contract = "The DeepSpeed contract (`moe/deepspeed_adapter.py`)"
    assert slug(contract) == "the-deepspeed-contract-moedeepspeed_adapterpy"
    assert slug("Transformer LMs: MHA, MoA, MAE") == "transformer-lms-mha-moa-mae"
    assert slug("Tables 7 and 8 -- presets") == "tables-7-and-8----presets"   # each space a '-', none merged
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B `c`\n") == {"a", "a-1", "b-c"}


def test_links_are_found_where_a_reader_sees_them():
    text = "see [a](x.md#y) and [b\nc](z.md)\n```\n[not](code.md)\n```\n`[nor](this.md)` [d](https://e.f)\n"
    assert links(text) == [(1, "x.md#y"), (1, "z.md"), (6, "https://e.f")]
