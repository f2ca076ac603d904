"""DeepSpeed's private names live in moe_scale/deepspeed_internals.py only, and the installed DeepSpeed has them.

An upgrade of DeepSpeed that renames or drops one fails here, naming it, instead of deep inside a run."""

import ast
from importlib.util import find_spec
from pathlib import Path

import pytest

from moe_scale.deepspeed_internals import PRIVATE_NAMES, TESTED_VERSIONS
from tests.paths import REPO

BOUNDARY = REPO / "moe_scale" / "deepspeed_internals.py"
DEEPSPEED = Path(find_spec("deepspeed").submodule_search_locations[0])


def private_uses(source: str) -> list[str]:
    """Where `source` uses a name of PRIVATE_NAMES: as an attribute, in an import, or inside a string."""
    names = set(PRIVATE_NAMES)
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            uses.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            modules += [alias.name for alias in node.names]
            for module in modules:
                if names & set(module.split(".")):
                    uses.append(f"line {node.lineno}: import {module}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            uses += [f"line {node.lineno}: {name!r} in a string" for name in names if _names_it(node.value, name)]
    return uses


def _names_it(text: str, name: str) -> bool:
    """A file or segment name anywhere in the string, a module or function name as a part of a dotted
    deepspeed path (a dict key "global_steps" of our own is not DeepSpeed's attribute)."""
    if not name.isidentifier() or name.startswith("deepspeed"):
        return name in text
    return text.startswith("deepspeed.") and name in text.split(".")


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "moe_scale").rglob("*.py")
                                        if p != BOUNDARY))
def test_no_module_but_the_boundary_uses_a_private_deepspeed_name(path):
    uses = private_uses((REPO / path).read_text())
    assert not uses, f"{path} uses DeepSpeed internals (move them to moe_scale/deepspeed_internals.py): {uses}"


def test_the_check_sees_each_kind_of_use():
    assert private_uses("from deepspeed.utils import groups\ngroups._get_data_parallel_group()")
    assert private_uses("p._hp_mapping.lp_fragment_address")
    assert private_uses("from deepspeed.ops.triton_ops._triton import is_triton_available")
    assert private_uses("import_module('deepspeed.ops.triton_ops.group_gemm_triton')")
    assert private_uses("Path('mp_rank_00_model_states.pt')")
    assert private_uses("f'/dev/shm/deepspeed_allreduce_buffer_{uid}'")
    assert private_uses("_get_build_directory('deepspeed_shm_comm')")
    assert not private_uses("common = {'global_steps': 3}\nengine.save_checkpoint(path)")


def test_the_boundary_lists_every_private_name_it_uses():
    source = BOUNDARY.read_text()
    tree = ast.parse(source)
    underscored = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                   and node.attr.startswith("_") and not node.attr.startswith("__")}
    assert underscored <= set(PRIVATE_NAMES), underscored - set(PRIVATE_NAMES)
    code = source.split("PRIVATE_NAMES = {", 1)[1].split("\n}\n", 1)[1]   # below the table
    assert [name for name in PRIVATE_NAMES if name not in code] == []    # no entry left over


@pytest.mark.parametrize("name", sorted(PRIVATE_NAMES))
def test_the_installed_deepspeed_still_has_it(name):
    file, text = PRIVATE_NAMES[name]
    path = DEEPSPEED / file
    assert path.is_file(), f"DeepSpeed no longer has {file} ({name}): update moe_scale/deepspeed_internals.py"
    assert text in path.read_text(), f"DeepSpeed's {file} no longer has {text!r} ({name})"


def test_the_declared_versions_are_the_tested_ones():
    assert f'"deepspeed{TESTED_VERSIONS}"' in (REPO / "pyproject.toml").read_text()
