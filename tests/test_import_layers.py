"""Imports flow one way: each room of the package (a top-level module or folder of moe_scale/) stands on a floor,
and no module imports from a room on a higher floor, at its top or inside a function. A new room must be given its
floor here; the order is the architecture (docs/layout.md)."""

from __future__ import annotations

import ast

from tests.paths import REPO

FLOORS = [   # from the ground up; rooms on one floor may import each other
    {"errors", "interrupts", "files", "labels", "run_files", "deepspeed_internals", "host_memory", "console"},
    {"config"},
    {"distributed", "data", "layout"},
    {"moe"},
    {"attention", "metrics"},
    {"models"},
    {"weights"},
    {"accounting"},
    {"train"},
    {"inference"},
    {"commands"},
    {"cli", "__main__"},
]
FLOOR = {room: n for n, rooms in enumerate(FLOORS) for room in rooms}
PACKAGE = REPO / "moe_scale"


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "moe_scale" and len(parts) > 1 else None


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            if node.module == "moe_scale":   # from moe_scale import x: the room is x
                yield from ((node.lineno, f"moe_scale.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)


def test_every_room_has_a_floor():
    rooms = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | \
        {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(FLOOR), f"rooms without a floor: {sorted(rooms - set(FLOOR))}; " \
                                f"floors without a room: {sorted(set(FLOOR) - rooms)}"


def test_no_import_climbs_back_up():
    climbs = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if here == "__init__":
            continue
        for line, module in _imports(ast.parse(path.read_text())):
            there = _room(module)
            if there is not None and FLOOR[there] > FLOOR[here]:
                climbs.append(f"{path.relative_to(REPO)}:{line} {here} (floor {FLOOR[here]}) imports {module} "
                              f"(floor {FLOOR[there]})")
    assert not climbs, "\n".join(climbs)


def test_a_run_directory_names_its_files_in_one_place():
    """train_log.jsonl, summary.json ... appear as literals only in run_files.py (config.json and tokenizer.json are
    transformers' names too, and vocab a tokenizer's key: those three are not checked)."""
    from moe_scale.run_files import RunFiles

    names = set(RunFiles.ALL) - {RunFiles.CONFIG, RunFiles.TOKENIZER, RunFiles.VOCAB}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "run_files.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not found, found
