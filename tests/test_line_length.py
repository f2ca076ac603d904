"""The style rule: no line of the project's Python (moe_scale/, tools/, tests/) is over 120 characters. Characters,
not bytes: `·` or `─▶` count one each (a byte-counting `awk length` reports such lines longer than they are)."""

from tests.paths import REPO

LIMIT = 120
ROOTS = ("moe_scale", "tools", "tests")


def long_lines(text: str) -> list[int]:
    """The 1-based numbers of the lines of `text` over LIMIT characters (a CRLF's CR not counted)."""
    return [number for number, line in enumerate(text.split("\n"), 1) if len(line.rstrip("\r")) > LIMIT]


def test_no_line_is_over_120_characters():
    files = sorted(path for root in ROOTS for path in (REPO / root).rglob("*.py"))
    assert files, f"no .py files under {', '.join(ROOTS)} in {REPO}"
    offending = [f"{path.relative_to(REPO).as_posix()}:{number}"
                 for path in files for number in long_lines(path.read_text(encoding="utf-8"))]
    assert not offending, f"{len(offending)} lines over {LIMIT} characters:\n" + "\n".join(offending)


def test_the_check_catches_what_it_is_for():
    assert long_lines("x" * LIMIT) == []
    assert long_lines("short\n" + "x" * (LIMIT + 1) + "\n\n" + "y" * (LIMIT + 5)) == [2, 4]
    assert long_lines("·" * LIMIT + "\r\n" + "─▶" * (LIMIT // 2)) == []   # characters, not bytes
    assert long_lines("·" * (LIMIT + 1) + "\r\n") == [1]
