"""DeepSpeed's private names live in moe_scale/deepspeed_internals.py only, and the installed DeepSpeed has them.

An upgrade of DeepSpeed that renames or drops one fails here, naming it, instead of deep inside a run."""

import ast
from importlib.util import find_spec
from pathlib import Path

import pytest

from moe_scale.deepspeed_internals import PRIVATE_NAMES, TESTED_VERSIONS
from tests.paths import REPO
from tests.moe.layers import moe_layer

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
    assert private_uses("from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder")
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


def test_the_replaced_zero_methods_are_the_ones_they_were_written_from():
    """deepspeed_internals.ZERO_NORM_METHODS: an upgrade that changes DeepSpeed's get_grad_norm_direct or
    unscale_and_clip_grads fails here (and the replacements are not installed) until they are checked again."""
    from moe_scale.deepspeed_internals import zero_methods_unchanged

    assert zero_methods_unchanged()


def _zero_norm_worker(rank, world):
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from torch import nn

    from moe_scale.config import TrainConfig
    from op_count import OpCounter
    from moe_scale.layout.ds_config import complete_ds_config, load_ds_config
    from moe_scale.train.engine import TrainingEngine

    class Net(nn.Module):   # dense and expert parameters: two parameter groups
        def __init__(self):
            super().__init__()
            self.dense, self.moe = nn.Linear(8, 8), moe_layer(8, 16, 4, 2, reuse_grad_buffers=False)

        def forward(self, x):
            y, aux = self.moe(self.dense(x))
            return y.float().pow(2).mean() + aux

    torch.manual_seed(rank)
    model = Net()
    model.moe.set_deepspeed_parallelism()
    source = str(REPO / "ds_configs" / "gpu_bf16_zero2.json")
    trainer = TrainingEngine(model, complete_ds_config(load_ds_config(source), 4, 1, world, source), TrainConfig())
    engine, optimizer = trainer.engine, trainer.engine.optimizer
    engine.backward(engine(torch.randn(4, 8).bfloat16()) * 1000)   # gradients large enough to be clipped
    assert "get_grad_norm_direct" in vars(optimizer) and "unscale_and_clip_grads" in vars(optimizer)
    norms = []
    for i in range(len(optimizer.bit16_groups)):
        grads, params = optimizer.averaged_gradients[i], optimizer.params_in_partition[i]
        norms.append((optimizer.get_grad_norm_direct(grads, params),
                      DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, grads, params)))
        broken = [g.clone() for g in grads]
        for bad in (float("nan"), float("inf")):   # a non-finite norm: the -1 DeepSpeed marks it with
            broken[0].view(-1)[0] = bad
            norms.append((optimizer.get_grad_norm_direct(broken, params),
                          DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, broken, params)))
    clipped = []
    flat = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    for total in (0.5, 50.0, float("nan"), float("inf"), -1.0):
        ours, theirs = [flat.clone()], [flat.clone()]
        with OpCounter() as reads:
            optimizer.unscale_and_clip_grads(ours, torch.tensor(total))
        with OpCounter() as deepspeeds_reads:
            DeepSpeedZeroOptimizer.unscale_and_clip_grads(optimizer, theirs, torch.tensor(total))
        clipped.append((total, ours[0], theirs[0], reads.host_syncs, deepspeeds_reads.host_syncs))
    return norms, clipped


def test_zero_norm_and_clipping_on_the_device_give_deepspeeds_numbers():
    """The replacements of deepspeed_internals.zero_norm_without_host_reads, installed by TrainingEngine on a real
    ZeRO-2 bf16 engine: each parameter group's norm as DeepSpeed's (non-finite ones marked -1 as it marks them), and
    the clipped gradients as DeepSpeed clips them for a norm to clip by, one below the threshold, and invalid ones
    (NaN, inf, DeepSpeed's -1 mark) - without DeepSpeed's read of the device."""
    import torch

    from tests.multiproc import run_ranks

    ((norms, clipped),) = run_ranks(_zero_norm_worker, world_size=1, deepspeed=True)
    assert len(norms) == 6
    for ours, theirs in norms:
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert [float(ours) for ours, _ in norms[1::3] + norms[2::3]] == [-1.0] * 4
    for total, ours, theirs, reads, deepspeeds_reads in clipped:
        assert torch.equal(ours, theirs) or torch.isnan(ours).all() and torch.isnan(theirs).all(), total
        assert (reads, deepspeeds_reads) == (0, 1), total
    below, above = clipped[0][1], clipped[1][1]   # a norm of 0.5 is left alone; one of 50 scaled to 1 (clip 1.0)
    torch.testing.assert_close(above, below / (50 + 1e-6), rtol=1e-6, atol=0)


def test_the_clipping_factor_is_made_once_per_norm_and_again_when_the_norm_changes():
    """DeepSpeed calls unscale_and_clip_grads once per parameter group with the same norm tensor: the factor is
    computed at the first call and reused; a norm changed in place (or another tensor) gets a new one."""
    from types import SimpleNamespace

    import torch

    from moe_scale.deepspeed_internals import _unscale_and_clip_grads

    optimizer = SimpleNamespace(clip_grad=1.0, loss_scale=1.0, device="cpu")
    norm = torch.tensor(4.0)
    first, second = [torch.ones(3)], [torch.full((2,), 2.0)]
    _unscale_and_clip_grads(optimizer, [first], norm)
    factor = optimizer.moe_scale_inverse_scale[1]
    _unscale_and_clip_grads(optimizer, [second], norm)
    assert optimizer.moe_scale_inverse_scale[1] is factor
    torch.testing.assert_close(first[0], torch.full((3,), 1 / (4.0 + 1e-6)))
    torch.testing.assert_close(second[0], torch.full((2,), 2 / (4.0 + 1e-6)))
    norm.fill_(0.5)   # in place: below the limit, nothing clipped
    third = [torch.ones(2)]
    _unscale_and_clip_grads(optimizer, [third], norm)
    assert optimizer.moe_scale_inverse_scale[1] is not factor and torch.equal(third[0], torch.ones(2))


def test_no_cpu_communication_op_is_built_within_the_block():
    """DeepSpeed's own build_shm_op (what its TorchBackend calls at init) finds no builder within the block, so
    nothing compiles, loads or maps /dev/shm; every other op builder is the accelerator's, and after the block the
    accelerator is as it was."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    from moe_scale.deepspeed_internals import without_cpu_comm_op

    accelerator = get_accelerator()
    with without_cpu_comm_op():
        assert build_shm_op() is None
        assert accelerator.create_op_builder("ShareMemCommBuilder") is None
        assert accelerator.create_op_builder("FusedAdamBuilder") is not None
    assert "create_op_builder" not in vars(accelerator)
    assert accelerator.create_op_builder("ShareMemCommBuilder") is not None


def _comm_op_worker(rank: int, world_size: int) -> bool:
    from deepspeed.comm import comm

    return comm.cdb.shm_comm_op is None


@pytest.mark.multiprocess
def test_ranks_initialised_through_moe_scale_hold_no_cpu_communication_op():
    from tests.multiproc import run_ranks

    assert run_ranks(_comm_op_worker, world_size=2, deepspeed=True) == [True, True]
