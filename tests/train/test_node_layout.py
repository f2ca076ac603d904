"""The hierarchical all-to-all's node layout: --node-size or the launcher's ranks per node, checked before training
(layout/checks.py, which `moe-scale plan` shares)."""

from __future__ import annotations

import pytest

from moe_scale.config import RunConfig
from moe_scale.distributed.launch import ranks_per_node
from moe_scale.errors import UserError
from moe_scale.layout.checks import check_world_layout


def _check(ep_size: int, node_size: int) -> int:
    config = RunConfig.from_settings(ep_size=ep_size, all_to_all="hierarchical", num_experts=8, batch_size=16)
    return check_world_layout(config, 8, lambda: ranks_per_node(node_size))


def test_hierarchical_node_layout_is_checked(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match="pass --node-size"):
        _check(4, 0)
    with pytest.raises(UserError, match="must divide one another"):
        _check(4, 3)
    assert _check(4, 2) == _check(2, 8) == 2          # whole nodes / inside one node: fine; 16 rows over 8 ranks
    monkeypatch.setenv("LOCAL_SIZE", "3")                      # the deepspeed launcher's variable
    with pytest.raises(UserError, match="3 ranks per node"):
        _check(4, 0)


def test_the_world_checks_name_their_flags():
    config = RunConfig.from_settings(ep_size=3, num_experts=6, batch_size=12)
    with pytest.raises(UserError, match="--ep-size 3 does not divide the 4 processes"):
        check_world_layout(config, 4, lambda: 4)
    with pytest.raises(UserError, match="--batch-size 12 is not divisible by processes x --grad-accum = 9"):
        check_world_layout(RunConfig.from_settings(batch_size=12, grad_accum=3), 3, lambda: 3)
