"""Sparse upcycling: every expert a copy of the dense FFN, so at step 0 (gates summing to 1, no noise) the MoE model
computes what the dense model did; noise makes the copies differ by its size; the run reuses the dense tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_scale.config import RunConfig
from moe_scale.deepspeed_internals import MODEL_STATES_FILE
from moe_scale.models.build import build_model
from moe_scale.train.upcycle import upcycle
from tests.cli_runs import TINY, run_train

VOCAB, TAG = 50, "step00000003"


def _config(**settings) -> RunConfig:
    config = RunConfig()
    for key, value in {"d_model": 16, "expert_hidden": 24, "num_experts": 8, "top_k": 2, "dropout": 0.0,
                       **settings}.items():
        config.set(key, value)
    return config


def _dense_run(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    dense = build_model(_config(layout="lstm-ffn-lstm", ffn_layers=1), VOCAB)
    with torch.no_grad():   # a trained FFN is not its initialisation: weights far from the init's range
        for p in dense.parameters():
            p.add_(0.3 * torch.randn_like(p))
    (tmp_path / "dense" / "checkpoints" / TAG).mkdir(parents=True)
    torch.save({"module": dense.state_dict()}, tmp_path / "dense" / "checkpoints" / TAG / MODEL_STATES_FILE)
    return tmp_path / "dense", dense.eval()


def _log_probs(model, ids_BT):
    return model.eval().decode(ids_BT)[0]


@pytest.mark.parametrize("gate", [{"gate": "noisy_topk"},
                                  {"gate": "hierarchical", "num_groups": 2, "top_k": 1, "top_k_secondary": 2}])
def test_at_step_0_the_upcycled_model_computes_what_the_dense_one_did(tmp_path, gate):
    run, dense = _dense_run(tmp_path)
    torch.manual_seed(1)
    moe = build_model(_config(**gate), VOCAB)
    upcycle(moe, run, TAG, noise=0.0, seed=5)
    ids_BT = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_log_probs(moe, ids_BT), _log_probs(dense, ids_BT), rtol=1e-5, atol=1e-5)
    # the router is new: not a copy of anything in the dense model
    fresh = build_model(_config(**gate), VOCAB)
    router = [name for name in moe.state_dict() if name.startswith("moe.router.")]
    assert router and all(torch.equal(moe.state_dict()[name], fresh.state_dict()[name]) for name in router)


def test_a_llama_blocks_swiglu_ffn_upcycles_into_mixtral_experts(tmp_path):
    """--block llama: the dense SwiGLU FFN into SwiGLU experts; Mixtral's gates (renormalised top-k) sum to 1."""
    llama = {"model": "transformer", "block": "llama", "num_layers": 2, "num_heads": 2, "seq_len": 8}
    torch.manual_seed(0)
    dense = build_model(_config(**llama, ffn="dense", ffn_hidden=24), VOCAB)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(0.3 * torch.randn_like(p))
    (tmp_path / "dense" / "checkpoints" / TAG).mkdir(parents=True)
    torch.save({"module": dense.state_dict()}, tmp_path / "dense" / "checkpoints" / TAG / MODEL_STATES_FILE)
    moe = build_model(_config(**llama, ffn="moe", gate="softmax_topk", moa_renormalize="full"), VOCAB)
    upcycle(moe, tmp_path / "dense", TAG, noise=0.0, seed=5)
    ids_BT = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_log_probs(moe, ids_BT), _log_probs(dense, ids_BT), rtol=1e-5, atol=1e-5)


def test_noise_sets_the_copies_apart_by_its_size_and_the_same_on_every_layout(tmp_path):
    run, dense = _dense_run(tmp_path)
    one = build_model(_config(), VOCAB)
    upcycle(one, run, TAG, noise=0.01, seed=5)
    w_in = one.moe.experts.w_in.detach()
    reference = dense.ffn.hidden[0].weight.detach()
    relative = (w_in - reference) / reference
    assert 0.005 < relative.std().item() < 0.015
    assert not torch.equal(w_in[0], w_in[1])
    second_half = build_model(_config(), VOCAB, ep_size=2, ep_rank=1)   # experts 4-7 on the second rank
    upcycle(second_half, run, TAG, noise=0.01, seed=5)
    assert torch.equal(second_half.moe.experts.w_in.detach(), w_in[4:])
    # the second of 2 processes also holds only its rows of the vocabulary tables (--vocab-exchange rows)
    split = build_model(_config(), VOCAB, ep_size=2, ep_rank=1, world=2, rank=1)
    upcycle(split, run, TAG, noise=0.01, seed=5)
    assert torch.equal(split.moe.experts.w_in.detach(), w_in[4:])
    rows = split.embedding.vocab.rows
    assert 0 < rows.first and torch.equal(split.embedding.weight.detach(),
                                          one.embedding.weight.detach()[rows.first:rows.first + rows.count])
    assert torch.equal(split.softmax.proj.weight.detach(),
                       one.softmax.proj.weight.detach()[rows.first:rows.first + rows.count])
    # --etp-size 2 beside 2 expert-parallel ranks: the last of 4 ranks holds the second half of the hidden units of
    # each of experts 4-7, the copies' noise drawn whole
    shard = build_model(_config(etp_size=2), VOCAB, ep_size=4, ep_rank=3)
    upcycle(shard, run, TAG, noise=0.01, seed=5)
    assert torch.equal(shard.moe.experts.w_in.detach(), w_in[4:, 12:])
    assert torch.equal(shard.moe.experts.w_out.detach(), one.moe.experts.w_out.detach()[4:, 12:])


@pytest.mark.slow
def test_an_upcycled_run_trains_on_the_dense_runs_tokenizer(tmp_path, embedded_cache):
    dense = tmp_path / "dense"
    common = ["--max-steps", "2", "--eval-interval", "100", "--checkpoint-interval", "2"]
    pairs = dict(zip(TINY[::2], TINY[1::2]))
    dense_only = [x for flag, value in pairs.items() if flag not in ("--num-experts", "--top-k") for x in (flag, value)]
    run_train([*dense_only, *common, "--layout", "lstm-ffn-lstm", "--ffn-layers", "1", "--out", str(dense)],
              cwd=tmp_path, cache=embedded_cache)
    moe = tmp_path / "moe"
    proc = run_train([*TINY, *common, "--upcycle-from", str(dense), "--upcycle-noise", "0.01", "--out", str(moe)],
                     cwd=tmp_path, cache=embedded_cache)
    assert f"upcycled from {dense} (checkpoint step00000002): every expert a copy of its FFN with 0.01 noise" \
        in proc.stdout
    assert (moe / "vocab").read_bytes() == (dense / "vocab").read_bytes()
    # a resume of the upcycled run continues from its own checkpoint (no second upcycling)
    proc = run_train(["--resume", "--max-steps", "3", "--out", str(moe)], cwd=tmp_path, cache=embedded_cache)
    assert "upcycled" not in proc.stdout
