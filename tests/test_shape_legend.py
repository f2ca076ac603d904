"""Every shape letter means one thing (docs/shapes.md): each module's legend names the letters its tensor names
use, each with the table's meaning."""

import ast
import re

import pytest

from tests.paths import REPO

SHAPES = (REPO / "docs" / "shapes.md").read_text()
TABLE = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\w+) \| (.+) \|$", SHAPES, re.M) if m.group(1) != "letter"}
FIRST_LAYER = {"X": "the first layer's width (F, or 2F for a gated kind)"}
LOCAL = {"moe_scale/models/softmax.py": {"S": "classes drawn per batch"},
         "moe_scale/moe/experts/kinds.py": FIRST_LAYER, "moe_scale/moe/experts/ffn.py": FIRST_LAYER,
         "moe_scale/models/vocab_parallel.py": {"S": "classes drawn per batch", "R": "table rows this rank holds",
                                                "U": "distinct ids this rank's batch needs",
                                                "K": "ids asked for (N, or N + S)",
                                                "M": "tokens of all P ranks"}}
# multi-letter tokens first, so "Kp" is one letter and not K then p
TOKEN = re.compile("|".join(sorted(map(re.escape, TABLE), key=len, reverse=True)) + "|[A-Z]")
STOP = {"the", "of", "a", "an", "per", "on", "this", "that", "and", "for", "in", "one", "each", "its", "or", "as",
        "to", "by", "at", "all", "is", "are", "there", "with", "here", "over"}
UNITS = {"ops_per_timestep_M", "params_excl_M", "total_params_B"}   # millions, billions: the papers' tables' units
MODULES = sorted(p.relative_to(REPO).as_posix() for root in ("moe_scale", "tools") for p in (REPO / root).rglob("*.py"))


def shape_letters(name: str) -> list[str] | None:
    """The letters a tensor name ends in (`gates_MKs` -> ["M", "Ks"]); None if it ends in none."""
    head, _, suffix = name.rpartition("_")
    if not head or not head[0].islower() or not re.fullmatch(r"[A-Z][A-Za-z0-9]*", suffix):
        return None
    letters = TOKEN.findall(suffix)
    return letters if "".join(letters) == suffix else None


def legend(doc: str) -> dict[str, str]:
    """{letter: its meaning} from the docstring's `Legend (docs/shapes.md): X meaning, Y = formula meaning, ...`."""
    match = re.search(r"Legend \(docs/shapes\.md\):(.*?)(?:\n\s*\n|\Z)", doc, re.S)
    if not match:
        return {}
    entries, depth, current = [], 0, ""
    for char in " ".join(match.group(1).split()):
        depth += char in "(["
        depth -= char in ")]"
        if char == "," and depth == 0:
            entries.append(current.strip())
            current = ""
        else:
            current += char
    entries.append(current.strip().rstrip("."))
    found = {}
    for entry in filter(None, entries):
        letter, _, meaning = entry.partition(" ")
        found[letter] = meaning
    return found


def words(text: str) -> set[str]:
    return {w.rstrip("s") for w in re.findall(r"[a-z][a-z0-9]+", text.lower()) if w not in STOP and len(w) > 2}


def module_names(source: str) -> set[str]:
    tree = ast.parse(source)
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
           {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)} | \
           {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


@pytest.mark.parametrize("path", MODULES)
def test_the_module_legend_agrees_with_shapes_md(path):
    source = (REPO / path).read_text()
    doc = ast.get_docstring(ast.parse(source)) or ""
    used = {letter for name in module_names(source) - UNITS for letter in (shape_letters(name) or ())}
    declared = legend(doc)
    if used and not declared:
        pytest.fail(f"{path} names tensors by shape ({sorted(used)}) but its docstring has no "
                    f"'Legend (docs/shapes.md):' line")
    undeclared = used - set(declared)
    assert not undeclared, f"{path}: letters {sorted(undeclared)} are used but not in its legend"
    table = {**TABLE, **LOCAL.get(path, {})}
    for letter, meaning in declared.items():
        assert letter in table, f"{path}: legend letter {letter!r} is not in docs/shapes.md"
        assert words(meaning) & words(table[letter]), (
            f"{path}: {letter} is {meaning!r} here but {table[letter]!r} in docs/shapes.md")


def test_the_checks_catch_what_they_are_for():
    assert shape_letters("gates_MKs") == ["M", "Ks"]
    assert shape_letters("top_values_NK1") == ["N", "K1"]
    assert shape_letters("kv_ZTd") == ["Z", "T", "d"]
    assert shape_letters("DS_EXPERT_PREFIX") is None and shape_letters("x_nd") is None
    doc = "Legend (docs/shapes.md): N tokens, M (token, expert) pairs, L = E / P local experts.\n\nMore."
    assert legend(doc) == {"N": "tokens", "M": "(token, expert) pairs", "L": "= E / P local experts"}
    assert not words("sequences of the group") & words(TABLE["S"])     # S is not sequences
    assert words("tokens") & words(TABLE["N"])
