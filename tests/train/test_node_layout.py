"""The hierarchical all-to-all's node layout: --node-size or the launcher's ranks per node, checked before training."""

from __future__ import annotations

import pytest


def test_hierarchical_node_layout_is_checked(monkeypatch):
    from moe_scale.errors import UserError
    from moe_scale.train.loop import _check_node_layout

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match="pass --node-size"):
        _check_node_layout(4, 0)
    with pytest.raises(UserError, match="must divide one another"):
        _check_node_layout(4, 3)
    _check_node_layout(4, 2), _check_node_layout(2, 8)          # whole nodes / inside one node: fine
    monkeypatch.setenv("LOCAL_SIZE", "3")                      # the deepspeed launcher's variable
    with pytest.raises(UserError, match="3 ranks per node"):
        _check_node_layout(4, 0)
