"""`open_trained_run` (inference/trained_run.py) is how every command opens a trained run: eval, generate,
prune-heads and export, run as a user runs them on the same run, each open it there and get the same model (the
same softmax, weights and next-word distributions); eval spreads the experts over the processes of a launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_scale.cli import main as cli_main
from moe_scale.data import Vocab
from moe_scale.moe.deepspeed_adapter import DS_EXPERT_PREFIX
from tests.cli_runs import TINY, run_cli, run_train

IDS = [[Vocab.BOS_ID, 5, 9, 3, 17, 40]]


def open_and_record(argv: list[str]) -> int:
    """`moe-scale ARGV[1:]`, saving to ARGV[0].rank<r> what each `open_trained_run` call gave the command: the
    command named, the checkpoint, the softmax, every weight, and (one process) the next-word log-probabilities
    after IDS."""
    import moe_scale.commands.prune_heads as prune_heads
    from moe_scale.inference import trained_run
    from moe_scale.models.vocab_parallel import vocabulary_shards

    opened, records = trained_run.open_trained_run, []

    def recording(run, checkpoint, command, **options):
        trained = opened(run, checkpoint, command, **options)
        records.append({"command": command, "checkpoint": trained.checkpoint,
                        "softmax": type(trained.model.softmax).__name__,
                        "state": {k: v.clone() for k, v in trained.model.state_dict().items()},
                        "rows": {k: (shard.first, shard.param.detach().clone())
                                 for k, shard in vocabulary_shards(trained.model).items()},
                        "log_probs": trained.model.decode(torch.tensor(IDS))[0]
                        if trained.env.world_size == 1 else None})
        torch.save(records, f"{argv[0]}.rank{trained.env.rank}")
        return trained

    trained_run.open_trained_run = prune_heads.open_trained_run = recording
    return cli_main(argv[1:])


@pytest.fixture
def mha_moe_run(tmp_path, embedded_cache) -> Path:
    """A transformer every command takes: MHA attention (prune-heads), an MoE FFN and the adaptive softmax."""
    run = tmp_path / "run"
    run_train([*TINY, "--model", "transformer", "--attention", "mha", "--num-heads", "4", "--ffn", "moe",
               "--num-layers", "2", "--softmax", "adaptive", "--adaptive-cutoffs", "100,1000", "--max-steps", "1",
               "--out", str(run)], cwd=run.parent, cache=embedded_cache)
    return run


def test_the_four_commands_open_the_same_model_through_open_trained_run(mha_moe_run, tmp_path, embedded_cache):
    """prune-heads opens the run a second time for the unpruned model it times against (issue 41: a deep copy
    failed on an MoE FFN, whose layers hold process groups)."""
    run = str(mha_moe_run)
    commands = {
        "eval": ["eval", "--run", run],
        "generate": ["generate", "--run", run, "--max-new-tokens", "3"],
        "prune-heads": ["prune-heads", "--run", run, "--steps", "2", "--fraction-per-step", "0.25",
                        "--max-batches", "1", "--out", str(tmp_path / "pruning")],
        "export": ["export", "--run", run, "--out", str(tmp_path / "hf")],
    }
    opened = {}
    for name, args in commands.items():
        record = tmp_path / f"{name}.pt"
        run_cli(str(record), *args, cwd=tmp_path, cache=embedded_cache, entry=open_and_record, check=True)
        opened[name] = torch.load(f"{record}.rank0", weights_only=False)
    assert (tmp_path / "pruning" / "pruning.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    assert {name: [r["command"] for r in records] for name, records in opened.items()} == {
        "eval": ["eval"], "generate": ["generate"], "export": ["export"],
        "prune-heads": ["prune-heads", "prune-heads"]}   # the model to prune, and the unpruned one to time
    reference = opened["eval"][0]
    assert reference["softmax"] == "AdaptiveSoftmax" and reference["checkpoint"] == "step00000001"
    for record in (r for records in opened.values() for r in records):
        assert (record["softmax"], record["checkpoint"]) == (reference["softmax"], reference["checkpoint"])
        assert record["state"].keys() == reference["state"].keys()
        for key, value in record["state"].items():
            assert torch.equal(value, reference["state"][key]), (record["command"], key)
        assert torch.equal(record["log_probs"], reference["log_probs"]), record["command"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_eval_spreads_the_experts_over_the_processes_of_a_launch(lstm_run, tmp_path, embedded_cache):
    results, opened = [], []
    for nprocs in (1, 2):
        record = tmp_path / f"eval{nprocs}.pt"
        proc = run_cli(str(record), "eval", "--json", "--run", str(lstm_run), cwd=tmp_path, cache=embedded_cache,
                       nprocs=nprocs, entry=open_and_record, check=True)
        results.append(json.loads(proc.stdout))   # rank 0 prints the result, rank 1 nothing
        opened.append([torch.load(f"{record}.rank{r}", weights_only=False)[0] for r in range(nprocs)])
    one, two = results
    assert (two["tokens"], two["words_predicted"]) == (one["tokens"], one["words_predicted"])
    assert two["ppl"] == pytest.approx(one["ppl"], rel=1e-6)
    [[whole]], halves = [[r["state"] for r in records] for records in opened[:1]], opened[1]
    assert opened[0][0]["rows"] == {}
    tables = set(halves[0]["rows"])
    assert tables >= {"embedding.weight"}
    for rank, record in enumerate(halves):   # rank r holds global experts 4r..4r+3 of the 8 and its rows of the
        half = record["state"]               # vocabulary tables, the rest whole
        assert half.keys() == {k for k in whole if (_local_expert(k) is None or _local_expert(k) < 4)
                               and k not in tables}
        for key, (first, rows) in record["rows"].items():
            assert first == (0 if rank == 0 else halves[0]["rows"][key][1].shape[0])
            assert torch.equal(rows, whole[key][first:first + rows.shape[0]]), (rank, key)
        for key, value in half.items():
            local = _local_expert(key)
            same = key if local is None else key.replace(f"{DS_EXPERT_PREFIX}{local}.",
                                                         f"{DS_EXPERT_PREFIX}{4 * rank + local}.")
            assert torch.equal(value, whole[same]), (rank, key)


def _local_expert(key: str) -> int | None:
    """The expert id in an expert weight's checkpoint key (local to its rank), None for any other key."""
    return int(key.split(DS_EXPERT_PREFIX)[1].split(".")[0]) if DS_EXPERT_PREFIX in key else None
