"""One training run: check inputs, build data, model and DeepSpeed engine, loop, evaluate, checkpoint, summarise.

Every random stream is a function of (seed, step, rank), and the data position a function of the step, so
a resumed run repeats an uninterrupted one exactly, and `--noise-rng global` with dropout 0 makes runs with
different world sizes on the same global batch take the same steps.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from moe_scale.config import RunConfig
from moe_scale.distributed.comm import collective_device
from moe_scale.distributed.launch import DistEnv, init_distributed
from moe_scale.errors import UserError
from moe_scale.metrics.balance import MeanTracker, MoEMetrics
from moe_scale.metrics.flops import lstm_moe_forward_macs_per_token, tflops_per_device, training_flops_per_token
from moe_scale.metrics.logging import RunLogger, summary_table
from moe_scale.models.lstm_lm import LSTMMoELM
from moe_scale.moe.routers import GlobalTokenNoise
from moe_scale.train.checkpoint import load_checkpoint, save_checkpoint
from moe_scale.train.data_setup import apply_token_budget, build_lm_data
from moe_scale.train.ds_config import complete_ds_config, load_ds_config
from moe_scale.train.engine import Trainer
from moe_scale.train.evaluate import evaluate
from moe_scale.train.factored_optimizer import check_optimizer_fits
from moe_scale.train.run_dir import check_run_dir, create_run_dir, write_json_atomic
from moe_scale.train.scale_options import build_softmax

_EVAL_TOTALS = ("ppl", "nll_per_token", "tokens")
TIMING_WARMUP_STEPS = 3   # first steps pay for allocation and DeepSpeed's lazy setup; not counted in tokens/s


def step_seed(seed: int, step: int, rank: int) -> int:
    return ((seed * 1_000_003 + step) * 65_537 + rank) % (2**63)


def check_parallel_layout(config: RunConfig, env: DistEnv) -> int:
    """Returns the micro-batch (sequences per rank per micro-step)."""
    t = config.train
    if env.world_size % t.ep_size:
        raise UserError(f"--ep-size {t.ep_size} does not divide the {env.world_size} processes; "
                        f"launch a multiple of {t.ep_size} processes or change --ep-size")
    per_step = env.world_size * t.grad_accum
    if t.batch_size % per_step:
        raise UserError(f"--batch-size {t.batch_size} is not divisible by processes x --grad-accum = {per_step}; "
                        f"use a multiple of {per_step}")
    return t.batch_size // per_step


def run_training(config: RunConfig) -> dict:
    # Every input is checked before the run directory is touched: a bad flag leaves nothing half-written.
    config.validate()
    t, m = config.train, config.model
    apply_token_budget(t, config.data.seq_len)   # --stream --token-budget sets the number of steps
    user_ds_config = load_ds_config(t.ds_config)
    check_optimizer_fits(t, user_ds_config, f"--ds-config {t.ds_config or '(built-in)'}")
    run = check_run_dir(t.out, t.resume, t.overwrite)
    env = init_distributed()
    micro_batch = check_parallel_layout(config, env)
    ds_config = complete_ds_config(user_ds_config, micro_batch, t.grad_accum, env.world_size,
                                   f"--ds-config {t.ds_config or '(built-in)'}")
    data = build_lm_data(config.data, env, global_rows=t.batch_size,
                         saved_vocab=run / "vocab" if t.resume else None, train_config=t)
    if env.rank == 0:
        create_run_dir(run, t.resume, t.overwrite)
        data.vocab.save(run / "vocab")
        config.save(run / "config.json")
        write_json_atomic(run / "ds_config.json", ds_config)
    dist.barrier()

    torch.manual_seed(t.seed)
    model = LSTMMoELM(m, len(data.vocab), ep_size=t.ep_size, ep_rank=env.rank % t.ep_size, seed=t.seed)
    model.softmax = build_softmax(t, model.softmax, data.vocab.counts)   # --softmax full|sampled|adaptive
    trainer = Trainer(model.to(env.device), ds_config, t)
    engine = trainer.engine
    noises = _install_noise(model, config, env)
    start_step = load_checkpoint(engine, run, data.train) if t.resume else 0
    if getattr(data.train, "last_step", None) is not None:   # resumed a streamed run whose one pass was done
        t.max_steps = start_step

    logger = RunLogger(run, t.max_steps, start_step, enabled=env.rank == 0)
    flops_per_step = training_flops_per_token({**lstm_moe_forward_macs_per_token(m, len(data.vocab)),
                                               "softmax": model.softmax.forward_macs_per_token()}) \
        * t.batch_size * config.data.seq_len
    interval, interval_moe, timed = MeanTracker(), MoEMetrics(model.moe_layers()), {"seconds": 0.0, "steps": 0}
    last_train, valid = {}, {}
    logger.line(f"training {_count(model)} on {env.world_size} process(es), ep_size={t.ep_size}, "
                f"{data.train.describe()}")
    for step in range(start_step, t.max_steps):
        if step >= t.max_steps:   # a streamed run's data ran out (one pass)
            break
        torch.manual_seed(step_seed(t.seed, step, env.rank))
        for noise in noises:
            noise.set_step(step)
        inputs, targets = data.train.batch(step, shuffle_seed=t.seed)
        if getattr(data.train, "last_step", None) == step:
            t.max_steps = step + 1
            logger.line(f"the streamed training data ends at step {step + 1}: the last step of this pass")
        began = time.perf_counter()
        sums = torch.zeros(3, dtype=torch.float64, device=collective_device())   # [NLL sum, tokens, aux sum]
        for micro_inputs, micro_targets in zip(inputs.chunk(t.grad_accum), targets.chunk(t.grad_accum)):
            out = engine(micro_inputs.to(env.device), micro_targets.to(env.device))
            trainer.backward_and_step(out.nll_sum / out.num_tokens + out.aux_loss)
            sums += torch.tensor([out.nll_sum.item(), out.num_tokens, out.aux_loss.item()], dtype=torch.float64,
                                 device=sums.device)
        if step - start_step >= TIMING_WARMUP_STEPS:
            timed["seconds"] += time.perf_counter() - began
            timed["steps"] += 1
        dist.all_reduce(sums)
        nll, tokens, aux = sums.tolist()
        record = {"step": step + 1, "loss": nll / tokens, "aux_loss": aux / (env.world_size * t.grad_accum),
                  "grad_norm": trainer.grad_norm, "lr": engine.get_lr()[0]}
        logger.step(record)
        interval.add({"nll": nll / tokens, "aux_loss": record["aux_loss"]})
        interval_moe.add()

        done = step + 1
        if done % t.log_interval == 0 or done == t.max_steps:
            last_train = {**interval.means(), **interval_moe.values()}
            interval.reset()
            interval_moe.reset()
            perf = _throughput(timed, t.batch_size * config.data.seq_len, flops_per_step, env.world_size)
            logger.scalars(done, {"train/loss": last_train["nll"], "train/ppl": math.exp(last_train["nll"]),
                                  "train/aux_loss": last_train["aux_loss"], "train/lr": record["lr"],
                                  **{f"moe/{name}": value for name, value in last_train.items()
                                     if name not in ("nll", "aux_loss")},
                                  "perf/tokens_per_s": perf["tokens_per_s"],
                                  "perf/tflops_per_device": perf["tflops_per_device"]})
            logger.line(f"step {done}/{t.max_steps}  loss {last_train['nll']:.4f}  "
                        f"ppl {math.exp(last_train['nll']):.2f}  cv(load) {last_train['cv_load']:.3f}  "
                        f"{perf['tokens_per_s']:.0f} tok/s")
        if done % t.eval_interval == 0 or done == t.max_steps:
            valid = evaluate(model, data.valid, t.eval_max_batches, env.device)
            logger.scalars(done, {"valid/ppl": valid["ppl"], **{f"valid_moe/{name}": value for name, value
                                                                  in valid.items() if name not in _EVAL_TOTALS}})
            logger.line(f"step {done}/{t.max_steps}  valid ppl {valid['ppl']:.2f}")
        if done % t.checkpoint_interval == 0 or done == t.max_steps:
            save_checkpoint(engine, run, done, env.rank, data.train)

    if not valid:   # resumed a run that had already finished
        valid = evaluate(model, data.valid, t.eval_max_batches, env.device)
    summary = _summary(config, env, data, last_train, valid, timed, flops_per_step)
    if env.rank == 0:
        write_json_atomic(run / "summary.json", summary)
        logger.line(summary_table(summary))
    logger.close()
    return summary


def _install_noise(model: LSTMMoELM, config: RunConfig, env: DistEnv) -> list[GlobalTokenNoise]:
    if config.train.noise_rng != "global":
        return []
    noises = []
    for index, layer in enumerate(model.moe_layers()):
        layer.router.noise_sampler = GlobalTokenNoise(config.train.seed, index, env.rank, env.world_size)
        noises.append(layer.router.noise_sampler)
    return noises


def _throughput(timed: dict, tokens_per_step: int, flops_per_step: float, world_size: int) -> dict[str, float]:
    if not timed["steps"]:
        return {"tokens_per_s": float("nan"), "tflops_per_device": float("nan")}
    step_seconds = timed["seconds"] / timed["steps"]
    return {"tokens_per_s": tokens_per_step / step_seconds,
            "tflops_per_device": tflops_per_device(flops_per_step, step_seconds, world_size)}


def _count(model: LSTMMoELM) -> str:
    experts = sum(p.numel() for p in model.moe.experts.parameters()) * model.moe.ep_size
    dense = sum(p.numel() for p in model.parameters()) - experts // model.moe.ep_size
    return f"{(dense + experts) / 1e6:.2f}M parameters ({experts / 1e6:.2f}M in {model.moe.num_experts} experts)"


def _summary(config, env, data, last_train, valid, timed, flops_per_step) -> dict:
    perf = _throughput(timed, config.train.batch_size * config.data.seq_len, flops_per_step, env.world_size)
    train_ppl = math.exp(last_train["nll"]) if last_train else float("nan")
    train_moe = {name: value for name, value in last_train.items() if name not in ("nll", "aux_loss")}
    valid_moe = {f"valid_{name}": value for name, value in valid.items() if name not in _EVAL_TOTALS}
    return {
        "steps": config.train.max_steps,
        "world_size": env.world_size,
        "ep_size": config.train.ep_size,
        "gate": config.model.gate,
        "train_ppl": train_ppl,
        "valid_ppl": valid["ppl"],
        "unigram_valid_ppl": data.unigram_valid_ppl(),
        "tokens_per_s": perf["tokens_per_s"],
        "tflops_per_device": perf["tflops_per_device"],
        **train_moe,
        **valid_moe,
    }
