"""A trained run opened for a command (eval, generate, prune-heads, export): its configuration, tokenizer and
model on a verified checkpoint, whatever number of processes and --ep-size trained it (DeepSpeed's files hold
one file per global expert). Every command opens a run here, so they all read it the same way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moe_scale.config import RunConfig
from moe_scale.errors import UserError
from moe_scale.run_files import RunFiles

if TYPE_CHECKING:
    from torch import nn

    from moe_scale.data.subwords import SubwordTokenizer
    from moe_scale.data.vocab import Vocab
    from moe_scale.distributed.launch import DistEnv


@dataclass
class TrainedRun:
    path: Path
    config: RunConfig
    checkpoint: str                        # the tag loaded, e.g. step00000400
    tokenizer: Vocab | SubwordTokenizer
    model: nn.Module                       # in eval mode, on env.device, its softmax the run's --softmax
    env: DistEnv                           # this process: rank, world size, device


def open_trained_run(run: Path | str, checkpoint: str | None, command: str, *, experts_over_processes: bool = False,
                     check: Callable[[RunConfig, Vocab | SubwordTokenizer], None] | None = None) -> TrainedRun:
    """Checkpoint `checkpoint` of `run` (default: its newest complete one). Its files and config are checked,
    and then `check(config, tokenizer)` (the command's own checks: the model kind, a prompt against the context),
    before anything slow is imported. One process, unless `experts_over_processes`: then every process of the
    launch holds its share of the experts (expert parallelism over all of them, as eval runs)."""
    from moe_scale.data.subwords import load_run_tokenizer
    from moe_scale.train.checkpoint import choose_checkpoint

    run = Path(run)
    if not RunFiles(run).config.exists() or not RunFiles(run).checkpoints.is_dir():
        raise UserError(f"--run {run}: no trained run there (config.json and a complete checkpoint are needed); "
                        f"pass the --out directory of a finished `moe-scale train`")
    config = RunConfig.load(RunFiles(run).config)
    tag, _ = choose_checkpoint(run, checkpoint, "--checkpoint", config)
    tokenizer = load_run_tokenizer(run)
    if check is not None:
        check(config, tokenizer)

    import deepspeed   # here, not at the top: flag errors come back before this slow import
    import torch

    from moe_scale.distributed.launch import init_distributed
    from moe_scale.models.build import build_model
    from moe_scale.models.vocab_parallel import connect_vocabulary
    from moe_scale.train.checkpoint import load_weights
    from moe_scale.train.sharded_experts import whole_experts

    env = init_distributed()
    if not experts_over_processes and env.world_size != 1:
        raise UserError(f"{command} runs in one process; start it without a launcher")
    if config.moe.experts.num_experts % env.world_size:
        raise UserError(f"{config.moe.experts.num_experts} experts cannot be split over {env.world_size} processes; "
                        f"launch a number of processes that divides it")
    trained = config
    if config.etp_size > 1:   # --etp-size: read back as whole experts
        config = whole_experts(config)
    torch.manual_seed(config.train.seed)
    model = build_model(config, len(tokenizer), ep_size=env.world_size, ep_rank=env.rank, seed=config.train.seed,
                        world=env.world_size, rank=env.rank,
                        counts=tokenizer.counts)
    connect_vocabulary(model)   # (deepspeed.initialize connects the expert layers, not the vocabulary tables)
    engine, *_ = deepspeed.initialize(model=model.to(env.device), dist_init_required=False,
                                      config={"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9})
    load_weights(engine, run, tag, module_only=True, sharded_from=trained if trained is not config else None)
    return TrainedRun(run, config, tag, tokenizer, model.eval(), env)
