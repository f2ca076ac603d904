"""The pre-flight memory check: its byte count by hand, and a model too large for the host refused in one line
before anything is allocated or written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_scale.errors import UserError
from moe_scale.train.memory_check import check_model_fits, parameter_bytes


class _Tiny(nn.Module):
    """10 dense parameters and 6 expert parameters (flagged as DeepSpeed flags them)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Parameter(torch.empty(10))
        self.expert = nn.Parameter(torch.empty(2, 3))
        self.expert.allreduce, self.expert.group_name = False, "ep_size_2"


@pytest.mark.parametrize("ds_config, optimizer, world, edp, per_dense, per_expert", [
    ({}, "adam", 1, 1, 16, 16),                                        # fp32 weight + grad + Adam m, v
    ({"zero_optimization": {"stage": 1}}, "adam", 4, 2, 4 + 4 + 8 / 4, 4 + 4 + 8 / 2),
    ({"zero_optimization": {"stage": 2}}, "adam", 4, 2, 4 + 4 / 4 + 8 / 4, 4 + 4 / 2 + 8 / 2),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "adam", 2, 1, 2 + 2 / 2 + 12 / 2, 2 + 2 + 12),
    ({}, "factored", 1, 1, 16, 8),                                     # factored expert state: no per-entry floats
])
def test_parameter_bytes_by_hand(ds_config, optimizer, world, edp, per_dense, per_expert):
    dense, experts, need = parameter_bytes(_Tiny(), ds_config, optimizer, world, edp)
    assert (dense, experts) == (10, 6)
    assert need == pytest.approx(10 * per_dense + 6 * per_expert)


def test_a_model_that_fits_passes_and_one_that_cannot_is_refused_with_its_numbers():
    check_model_fits(_Tiny, {}, "adam", 1, 1, torch.device("cpu"))

    def huge():   # 2^40 expert parameters: 16 TiB with Adam
        model = _Tiny()
        model.expert = nn.Parameter(torch.empty(2**20, 2**20))
        model.expert.allreduce, model.expert.group_name = False, "ep_size_1"
        return model

    with pytest.raises(UserError, match=r"cannot fit: .*1,099,511.6M expert parameters, at least 16,384.0 GiB.*"
                                        r"available; .*ZeRO stage 2"):
        check_model_fits(huge, {}, "adam", 1, 1, torch.device("cpu"))
