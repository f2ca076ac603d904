"""A trained run loaded into this one process (generate, prune-heads): its configuration and vocabulary, and
its model on a verified checkpoint, whatever number of processes and --ep-size trained it (DeepSpeed's files
hold one file per global expert)."""

from __future__ import annotations

from pathlib import Path

from moe_scale.config import RunConfig
from moe_scale.errors import UserError


def trained_config(run: Path, checkpoint: str | None) -> tuple[RunConfig, str]:
    """(the run's configuration, the checkpoint to load: `checkpoint`, else the newest complete one), checked
    before anything slow is imported."""
    from moe_scale.train.checkpoint import choose_checkpoint

    if not (run / "config.json").exists() or not (run / "checkpoints").is_dir():
        raise UserError(f"--run {run}: no trained run there (config.json and a complete checkpoint are needed); "
                        f"pass the --out directory of a finished `moe-scale train`")
    config = RunConfig.load(run / "config.json")
    tag, _ = choose_checkpoint(run, checkpoint, "--checkpoint", config)
    return config, tag


def load_model(run: Path, config: RunConfig, tag: str, command: str):
    """(vocab, model in eval mode with checkpoint `tag`'s weights and the run's softmax, device)."""
    import deepspeed   # here, not at the top: flag errors come back before this slow import
    import torch

    from moe_scale.data.subwords import load_run_tokenizer
    from moe_scale.distributed.launch import init_distributed
    from moe_scale.models.build import build_model
    from moe_scale.train.checkpoint import load_weights

    vocab = load_run_tokenizer(run)
    env = init_distributed()
    if env.world_size != 1:
        raise UserError(f"{command} runs in one process; start it without a launcher")
    torch.manual_seed(config.train.seed)
    model = build_model(config, len(vocab), seed=config.train.seed, counts=vocab.counts)
    engine, *_ = deepspeed.initialize(model=model.to(env.device), dist_init_required=False,
                                      config={"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9})
    load_weights(engine, run, tag, module_only=True)
    return vocab, model.eval(), env.device
