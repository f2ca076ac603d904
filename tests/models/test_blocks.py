"""The transformer block kinds (models/blocks.py): the config offers exactly the registered kinds, and each builds
the parts it declares."""

from __future__ import annotations

import pytest
from torch import nn

from moe_scale.config import RunConfig
from moe_scale.models.blocks import BLOCKS
from moe_scale.models.build import build_model


def test_the_config_offers_the_registered_blocks():
    assert RunConfig.leaves()["block"].field.metadata["choices"] == tuple(BLOCKS)


@pytest.mark.parametrize("name", BLOCKS)
def test_each_kind_builds_what_it_declares(name):
    kind = BLOCKS[name]
    config = RunConfig.from_settings(model="transformer", block=name, num_layers=2, num_heads=2, d_model=16,
                                     ffn_hidden=24, vocab_size=40)
    config.validate()
    lm = build_model(config, 40)
    assert lm.block_kind is kind
    assert all(type(m) is type(kind.norm(16, config)) for b in lm.blocks for m in (b.norm1, b.norm2))
    assert type(lm.final_norm) is type(kind.norm(16, config))
    assert (lm.softmax.proj.bias is not None) == kind.output_bias
    assert all((b.attn.rotary is not None) == kind.rotary for b in lm.blocks)
    assert sum(isinstance(m, nn.Linear) for m in lm.blocks[0].ffn.modules()) == kind.dense_ffn_matrices
