"""`moe-scale eval`: perplexity and balance statistics of a trained run on a split or on other text."""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed
import torch

from moe_scale.config import RunConfig
from moe_scale.data import LMWindows, Vocab, load_sentences, resolve_text_files
from moe_scale.distributed.launch import init_distributed
from moe_scale.errors import UserError
from moe_scale.models.build import build_model
from moe_scale.train.data_setup import load_run_splits, min_over_ranks
from moe_scale.train.evaluate import evaluate


def run_eval(run_dir: str, split: str, data: str | None) -> dict | None:
    """Evaluates the newest complete checkpoint; returns the result on rank 0 (None elsewhere)."""
    run = Path(run_dir)
    marker = run / "checkpoints" / "complete"
    if not (run / "config.json").exists() or not marker.exists():
        raise UserError(f"--run {run_dir}: no trained run there (config.json and a complete checkpoint are "
                        f"needed); pass the --out directory of a finished `moe-scale train`")
    config = RunConfig.load(run / "config.json")
    vocab = Vocab.load(run / "vocab")
    env = init_distributed()
    if config.model.num_experts % env.world_size:
        raise UserError(f"{config.model.num_experts} experts cannot be split over {env.world_size} processes; "
                        f"launch a number of processes that divides it")
    if data is not None:
        sentences = load_sentences(resolve_text_files(data, "--data"))
    else:
        _, valid, test = load_run_splits(config.data)
        sentences = valid if split == "valid" else test
    rows = config.train.batch_size if config.train.batch_size % env.world_size == 0 else env.world_size
    windows = LMWindows(sentences, vocab, seq_len=config.data.seq_len, global_rows=rows, rank=env.rank,
                        world_size=env.world_size, min_over_ranks=min_over_ranks, what=f"the {split} data")

    torch.manual_seed(config.train.seed)
    ep_size = env.world_size   # evaluation spreads the experts over all processes
    model = build_model(config.model, len(vocab), ep_size=ep_size, ep_rank=env.rank, seed=config.train.seed)
    engine, *_ = deepspeed.initialize(model=model.to(env.device), dist_init_required=False,
                                      config={"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9})
    tag = json.loads(marker.read_text())["tag"]
    engine.load_checkpoint(str(run / "checkpoints"), tag=tag, load_module_only=True,
                           load_optimizer_states=False, load_lr_scheduler_states=False)
    result = evaluate(model, windows, device=env.device)
    result = {"split": "data" if data else split, "checkpoint": tag, **result}
    return result if env.rank == 0 else None
