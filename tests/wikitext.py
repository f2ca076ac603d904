"""WikiText-2's valid and test splits, shipped gzipped in tests/fixtures/wikitext-2 (CC BY-SA 3.0; see its
README.md), so the suite needs nothing beside the clone."""

from __future__ import annotations

import gzip
from pathlib import Path

WIKITEXT = Path(__file__).resolve().parent / "fixtures" / "wikitext-2"


def wikitext_text(split: str) -> str:
    """WikiText-2's `valid` or `test` split as shipped with the tests."""
    with gzip.open(WIKITEXT / f"{split}.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()


def wikitext_sentences(split: str) -> list[str]:
    """WikiText-2 paragraphs split into sentences at ' . ' (each keeps its '.'); headings and blanks dropped."""
    out = []
    for line in wikitext_text(split).splitlines():
        line = line.strip()
        if not line or (line.startswith("=") and line.endswith("=")):
            continue
        parts = line.split(" . ")
        for j, part in enumerate(parts):
            s = part.strip() + (" ." if j < len(parts) - 1 else "")
            if s.strip(" ."):
                out.append(s.strip())
    return out
