"""Resume with another layout: a checkpoint written with one number of processes and --ep-size continues with
another, weights *and* optimizer state (fp32 masters, Adam's moments, step, schedule) moved to their new owners.
The continued run must equal the uninterrupted run of the original layout up to float reduction order (5e-7
here); optimizer state lost or misplaced shows as differences of 1e-3 and more from the first resumed step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moe_scale.errors import UserError
from moe_scale.train.reshard import _ExpertFiles
from tests.cli_runs import run_train, step_log
from tests.paths import DS_CONFIGS

CONFIGS = DS_CONFIGS
SETTINGS = ["--d-model", "32", "--expert-hidden", "32", "--num-experts", "4", "--seq-len", "16", "--batch-size", "8",
            "--eval-max-batches", "2", "--eval-interval", "100", "--log-interval", "1", "--checkpoint-interval", "2",
            "--noise-rng", "global", "--dropout", "0", "--max-steps", "4"]
ADAPTIVE = ("--softmax", "adaptive", "--adaptive-cutoffs", "50,200")   # each tail cluster's rows split too
HIERARCHICAL = ("--gate", "hierarchical", "--num-groups", "2", "--top-k", "1", "--top-k-secondary", "2")


def _resharded_run_matches(tmp_path, cache, before: tuple[int, ...], after: tuple[int, ...], ds: str,
                           extra: tuple[str, ...] = (), resume_extra: tuple[str, ...] = ()) -> None:
    """`before` and `after`: (processes, --ep-size[, --etp-size])."""
    (procs, ep, etp), (new_procs, new_ep, new_etp) = (*before, 1)[:3], (*after, 1)[:3]
    extra = (*extra, "--etp-size", str(etp)) if etp > 1 else extra
    resume_extra = (*resume_extra, "--etp-size", str(new_etp)) if new_etp != etp else resume_extra
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train([*SETTINGS, *extra, "--ds-config", str(CONFIGS / f"{ds}.json"), "--ep-size", str(ep), "--out",
               str(straight)], cwd=tmp_path, cache=cache, nprocs=procs)
    shutil.copytree(straight, resumed)
    (resumed / "checkpoints" / "complete").write_text(json.dumps({"tag": "step00000002", "step": 2}))
    run_train(["--resume", "--ep-size", str(new_ep), *resume_extra, "--out", str(resumed)], cwd=tmp_path, cache=cache,
              nprocs=new_procs)
    a, b = step_log(straight), step_log(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a[:2]] == [r["loss"] for r in b[:2]]   # kept from before the resume
    for x, y in zip(a[2:], b[2:]):
        assert abs(x["loss"] - y["loss"]) < 1e-5 and abs(x["grad_norm"] - y["grad_norm"]) < 1e-5, (x, y)
    layout = json.loads((resumed / "checkpoints" / "step00000004" / "layout.json").read_text())
    split = new_procs > 1 and "dense" not in resume_extra    # the tables are split over the processes by default
    softmax = ["softmax.inner.tail.0.1.weight", "softmax.inner.tail.1.1.weight"] if ADAPTIVE[0] in extra else \
        ["softmax.proj.bias", "softmax.proj.weight"]
    tables = ["embedding.weight", *softmax] if split else []
    assert layout == {"world_size": new_procs, "ep_size": new_ep * new_etp, "rows": "tokens", "vocab_rows": tables,
                      **({"etp_size": new_etp} if new_etp > 1 else {})}


@pytest.mark.multiprocess
@pytest.mark.parametrize("ds", ["zero2_ep", "cpu"])
def test_two_processes_resume_as_one(tmp_path, embedded_cache, ds):
    _resharded_run_matches(tmp_path, embedded_cache, (2, 2), (1, 1), ds)


@pytest.mark.multiprocess
def test_hierarchical_secondary_gates_live_and_move_with_their_groups(tmp_path, embedded_cache):
    """Each group's secondary gate is sharded with its experts: DeepSpeed's per-expert files hold column j of group
    i with expert i*G + j (and the dense file none of it), and a 2-rank run resumes as 1 process exactly."""
    _resharded_run_matches(tmp_path, embedded_cache, (2, 2), (1, 1), "zero2_ep", HIERARCHICAL)
    step = tmp_path / "straight" / "checkpoints" / "step00000002"
    dense = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert not [key for key in dense if "secondary" in key]
    columns = {}
    for path in sorted(step.glob("layer_*_expert_*_mp_rank_00_model_states.pt")):
        for key, value in torch.load(path, weights_only=False).items():
            if "secondary" in key:
                columns.setdefault(key.rsplit(".", 1)[1], []).append((key, tuple(value.shape), value))
    assert set(columns) == {"w_gate_secondary", "w_noise_secondary"}
    for name, entries in columns.items():
        assert [(key.split("deepspeed_experts.")[1], shape) for key, shape, _ in entries] == \
            [(f"{e}.router.{name}", (32,)) for e in range(4)]
        assert len({tuple(v.tolist()) for _, _, v in entries}) == 4   # trained: four different columns


@pytest.mark.multiprocess
def test_aux_free_biases_and_shared_experts_move_to_another_layout(tmp_path, embedded_cache):
    """The routing biases (a buffer, in the dense module file) and the shared experts (dense parameters) of a
    2-rank run resume as 1 process exactly: a bias lost on the way would route differently from step 3 on."""
    _resharded_run_matches(tmp_path, embedded_cache, (2, 2), (1, 1), "zero2_ep",
                           ("--gate", "aux_free", "--shared-experts", "2", "--shared-expert-gate"))
    dense = torch.load(tmp_path / "straight" / "checkpoints" / "step00000002" / "mp_rank_00_model_states.pt",
                       weights_only=False)["module"]
    assert torch.count_nonzero(dense["moe.router.score_bias"]) > 0
    assert {"moe.shared.w_in", "moe.shared.w_out", "moe.shared.w_gate"} <= set(dense)


@pytest.mark.multiprocess
def test_a_resume_may_keep_the_vocabulary_tables_whole_instead(tmp_path, embedded_cache):
    """The same 2 processes, the tables split by rows until step 2, then whole (--vocab-exchange dense): their rows
    and Adam state (the adaptive softmax's tails' too) come back whole from the portable files, and the run goes on
    as if it had never changed."""
    _resharded_run_matches(tmp_path, embedded_cache, (2, 2), (2, 2), "zero2_ep", ADAPTIVE,
                           resume_extra=("--vocab-exchange", "dense"))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("before, after, extra, ds", [
    ((1, 1), (2, 1, 2), ("--optimizer", "factored"), "cpu"), ((2, 1, 2), (2, 2), HIERARCHICAL, "zero2_ep"),
    ((2, 2), (4, 4), ADAPTIVE, "zero2_ep")], ids=["factored_1_to_etp2", "hierarchical_etp2_to_ep2", "ep2_to_ep4"])
def test_other_layout_changes(tmp_path, embedded_cache, before, after, extra, ds):
    """(processes, --ep-size[, --etp-size]): whole experts into shards on 2 ranks (the factored optimizer's row
    averages cut with them, its column averages whole on each, and its steps under --etp-size the whole matrices'),
    shards into whole experts on 2 expert-parallel ranks (--etp-size is a change a resume may make; the hierarchical
    gate's secondary gates, a copy beside each shard, go to their groups' ranks), and 2 expert-parallel ranks into
    4."""
    _resharded_run_matches(tmp_path, embedded_cache, before, after, ds, extra)


def _save_experts(directory: Path, per_file: int, total: int) -> dict:
    """Experts 0..total-1 of one parameter in files of `per_file`, value = global index."""
    directory.mkdir(parents=True)
    values = torch.arange(total, dtype=torch.float32).view(total, 1, 1).expand(total, 2, 3).clone()
    for r in range(total // per_file):
        part = values[r * per_file:(r + 1) * per_file]
        torch.save({"layer.experts.w": {"first": r * per_file, "total": total,
                                        "state": {"param": part, "exp_avg": part * 2, "step": 7}}},
                   directory / f"experts_ep{r}.pt")
    return values


@pytest.mark.parametrize("per_file, first, count", [(2, 1, 2), (1, 0, 4), (4, 2, 1), (2, 0, 4)])
def test_expert_slices_cross_file_boundaries(tmp_path, per_file, first, count):
    values = _save_experts(tmp_path / "portable", per_file, 4)
    state = _ExpertFiles(tmp_path / "portable").slice("layer.experts.w", first, count, 4)
    assert torch.equal(state["param"], values[first:first + count])
    assert torch.equal(state["exp_avg"], 2 * values[first:first + count]) and state["step"] == 7


def test_missing_or_mismatched_expert_files_are_one_line(tmp_path):
    _save_experts(tmp_path / "portable", 2, 4)
    (tmp_path / "portable" / "experts_ep1.pt").unlink()
    with pytest.raises(UserError, match="experts 1..2 of layer.experts.w are not all saved"):
        _ExpertFiles(tmp_path / "portable").slice("layer.experts.w", 1, 2, 4)
    with pytest.raises(UserError, match="holds 4 experts for layer.experts.w, the model 8"):
        _ExpertFiles(tmp_path / "portable").slice("layer.experts.w", 0, 2, 8)
