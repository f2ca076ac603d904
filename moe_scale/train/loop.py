"""One training run: check inputs, build data, model and DeepSpeed engine, loop, evaluate, checkpoint, summarise.

Every random stream is a function of (seed, step, rank), and the data position a function of the step, so
a resumed run repeats an uninterrupted one exactly, and `--noise-rng global` with dropout 0 makes runs with
different world sizes on the same global batch take the same steps.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from moe_scale.config import RunConfig
from moe_scale.distributed.comm import collective_device
from moe_scale.distributed.launch import DistEnv, init_distributed, ranks_per_node
from moe_scale.errors import UserError
from moe_scale.metrics.balance import MeanTracker, MoEMetrics
from moe_scale.accounting.flops import tflops_per_device, training_flops_per_token
from moe_scale.metrics.logging import RunLogger, summary_table
from moe_scale.metrics.perf import all_to_all_seconds, device_peak_tflops, efficiency, peak_rss_mib
from moe_scale.models.build import build_model, describe_parameters, forward_macs_per_token
from moe_scale.moe.router import GlobalTokenNoise
from moe_scale.train.memory_check import check_model_fits
from moe_scale.train.checkpoint import checkpoint_to_resume, load_checkpoint, save_checkpoint
from moe_scale.data.subwords import save_run_tokenizer
from moe_scale.train.data_setup import apply_token_budget, build_lm_data
from moe_scale.train.ds_config import complete_ds_config, load_ds_config
from moe_scale.train.engine import TrainingEngine
from moe_scale.train.evaluate import evaluate
from moe_scale.train.mae_bcd import mae_schedule
from moe_scale.train.factored_optimizer import check_optimizer_fits
from moe_scale.files import write_json_atomic
from moe_scale.train.run_dir import check_run_dir, claim_run_dir
from moe_scale.train.preemption import StopRequests
from moe_scale.train.step_stats import PendingSteps, StepTimer

_EVAL_TOTALS = ("ppl", "nll_per_token", "tokens", "words_predicted")
DIVERGED_LOSS = 1000.0     # nats per token: no model that still learns gets anywhere near it
TIMING_WARMUP_STEPS = 3   # first steps pay for allocation and DeepSpeed's lazy setup; not counted in tokens/s


def step_seed(seed: int, step: int, rank: int) -> int:
    return ((seed * 1_000_003 + step) * 65_537 + rank) % (2**63)


def check_parallel_layout(config: RunConfig, env: DistEnv) -> int:
    """Returns the micro-batch (sequences per rank per micro-step)."""
    t, ep_size, dispatch = config.train, config.parallel.ep_size, config.moe.dispatch
    if env.world_size % ep_size:
        raise UserError(f"--ep-size {ep_size} does not divide the {env.world_size} processes; "
                        f"launch a multiple of {ep_size} processes or change --ep-size")
    if dispatch.all_to_all == "hierarchical" and ep_size > 1:
        _check_node_layout(ep_size, dispatch.node_size)
    per_step = env.world_size * t.grad_accum
    if t.batch_size % per_step:
        raise UserError(f"--batch-size {t.batch_size} is not divisible by processes x --grad-accum = {per_step}; "
                        f"use a multiple of {per_step}")
    return t.batch_size // per_step


def _check_node_layout(ep_size: int, node_size: int) -> None:
    try:
        per_node = ranks_per_node(node_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    if ep_size % per_node and per_node % ep_size:
        raise UserError(f"--all-to-all hierarchical: {per_node} ranks per node and --ep-size {ep_size} must divide "
                        f"one another (an expert-parallel group is whole nodes, or lies inside one); "
                        f"set --node-size or --ep-size accordingly")


def run_training(config: RunConfig) -> dict:
    # Every input is checked before the run directory is touched: a bad flag leaves nothing half-written.
    config.validate()
    t, run_dir, ep_size = config.train, config.run, config.parallel.ep_size
    apply_token_budget(config)   # --stream --token-budget sets the number of steps
    ds_source = f"--ds-config {config.parallel.ds_config or '(built-in)'}"
    user_ds_config = load_ds_config(config.parallel.ds_config)
    check_optimizer_fits(t, user_ds_config, ds_source)
    run = check_run_dir(run_dir.out, run_dir.resume, run_dir.overwrite, run_dir.resume_from)
    env = init_distributed()
    micro_batch = check_parallel_layout(config, env)
    resume_tag = checkpoint_to_resume(run, run_dir.resume_from, config) if run_dir.resume else None   # files verified
    ds_config = complete_ds_config(user_ds_config, micro_batch, t.grad_accum, env.world_size, ds_source)
    data = build_lm_data(config.data, env, global_rows=t.batch_size,
                         saved_run=run if run_dir.resume else None, seed=t.seed)

    if env.device.type == "cuda":   # float32 products on TF32 tensor cores (bf16 runs are unaffected)
        torch.set_float32_matmul_precision("high")
    def build():
        return build_model(config, len(data.vocab), ep_size=ep_size, ep_rank=env.rank % ep_size, seed=t.seed,
                           counts=data.vocab.counts)

    check_model_fits(build, ds_config, t.optimizer, env.world_size, ep_size, env.device)   # on the meta device
    torch.manual_seed(t.seed)
    model = build()
    mae = mae_schedule(model, config, getattr(data.train, "num_windows", None))   # MAE's G steps, else None
    trainer = TrainingEngine(model.to(env.device), ds_config, t)
    engine = trainer.engine
    noises = _install_noise(model, config, env)
    start_step = load_checkpoint(engine, run, resume_tag, data.train) if run_dir.resume else 0
    # Only now, with every input checked and the engine built, does the run directory change.
    lock = claim_run_dir(run, run_dir.resume, run_dir.overwrite) if env.rank == 0 else None
    try:
        if env.rank == 0:
            save_run_tokenizer(data.vocab, run)
            config.save(run / "config.json")
            write_json_atomic(run / "ds_config.json", ds_config)
        dist.barrier()
        stop_requests = StopRequests()   # collective: every rank
        try:
            return _train(config, env, data, model, trainer, noises, mae, run, start_step, ds_config, stop_requests)
        finally:
            stop_requests.restore()
    finally:
        if lock is not None:
            lock.release()


def _train(config, env, data, model, trainer, noises, mae, run, start_step, ds_config, stop_requests) -> dict:
    t, r = config.train, config.run
    engine = trainer.engine
    if getattr(data.train, "last_step", None) is not None:   # resumed a streamed run whose one pass was done
        t.max_steps = start_step

    logger = RunLogger(run, t.max_steps, start_step, enabled=env.rank == 0)
    flops_per_step = training_flops_per_token({**forward_macs_per_token(config, len(data.vocab), config.data.seq_len),
                                               "softmax": model.softmax.forward_macs_per_token()}) \
        * t.batch_size * config.data.seq_len
    interval, interval_moe = MeanTracker(), MoEMetrics(model.moe_layers())
    for record in logger.resumed_records:   # a resume mid-interval: the interval's earlier steps count too
        if record["step"] > start_step - start_step % r.log_interval:
            interval.add({"nll": record["loss"], "aux_loss": record["aux_loss"]})
    pending = PendingSteps()   # each step's numbers stay on the device until a log, eval or checkpoint point
    timer = StepTimer(env.device, lambda: all_to_all_seconds(model.moe_layers()))
    peak = _peak(env, ds_config)
    last_train, valid, record = {}, {}, {}
    logger.line(f"training {describe_parameters(model)} on {env.world_size} process(es), "
                f"ep_size={config.parallel.ep_size}, {data.train.describe()}; MFU against a peak of {peak[0]:.4g} "
                f"TFLOPS per device ({peak[1]})")
    if config.data.tokenizer != "words":
        logger.line(f"tokenizer {config.data.tokenizer}: {len(data.vocab)} tokens, {data.train.tokens_per_word:.3f} "
                    f"per word of the training text; perplexities are per word (exp(total NLL / words))")
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
        if step - start_step >= TIMING_WARMUP_STEPS:   # the first steps pay for allocation and lazy setup
            timer.start()
        if mae is not None:
            mae.g_step_if_due(step, inputs, targets, env.device)
        sums = torch.zeros(3, dtype=torch.float64, device=collective_device())   # [NLL sum, tokens, aux sum]
        for micro_inputs, micro_targets in zip(inputs.chunk(t.grad_accum), targets.chunk(t.grad_accum)):
            out = engine(to_device(micro_inputs, env.device), to_device(micro_targets, env.device))
            trainer.backward_and_step(out.nll_sum / out.num_tokens + out.aux_loss)
            sums += torch.stack([out.nll_sum.detach().double(), out.nll_sum.new_full((), out.num_tokens).double(),
                                 out.aux_loss.detach().double()]).to(sums.device)
        dist.all_reduce(sums)
        pending.add(step + 1, engine.get_lr()[0], sums, trainer.grad_norm)
        interval_moe.add()
        timer.step_done()

        done = step + 1
        stop = stop_requests.agreed()   # SIGTERM / SIGINT / SIGUSR1 on any rank: checkpoint and stop
        log_now = done % r.log_interval == 0 or done == t.max_steps or stop
        eval_now = done % r.eval_interval == 0 or done == t.max_steps
        checkpoint_now = r.checkpoint_interval > 0 and (done % r.checkpoint_interval == 0 or done == t.max_steps
                                                          or stop)
        if not (log_now or eval_now or checkpoint_now):
            continue
        timer.stop()
        for record in pending.flush(env.world_size * t.grad_accum):   # the one read of the steps' numbers
            logger.step(record)
            _stop_if_diverged(record, run, logger)   # before any evaluation or checkpoint of a broken model
            interval.add({"nll": record["loss"], "aux_loss": record["aux_loss"]})
        if log_now:
            last_train = {**interval.means(), **interval_moe.values()}
            logger.expert_loads(done, interval_moe.relative_loads())
            interval.reset()
            interval_moe.reset()
            perf = _throughput(timer.take_interval(), t.batch_size * config.data.seq_len, flops_per_step,
                               env.world_size, peak[0])
            train_ppl = _word_ppl(last_train["nll"], data)
            logger.scalars(done, {"train/loss": last_train["nll"], "train/ppl": train_ppl,
                                  "train/aux_loss": last_train["aux_loss"], "train/lr": record["lr"],
                                  **{f"moe/{name}": value for name, value in last_train.items()
                                     if name not in ("nll", "aux_loss")},
                                  "perf/tokens_per_s": perf["tokens_per_s"],
                                  "perf/tflops_per_device": perf["tflops_per_device"],
                                  "perf/mfu": perf["mfu"], "perf/all_to_all_share": perf["all_to_all_share"]})
            balance = f"  cv(load) {last_train['cv_load']:.3f}" if "cv_load" in last_train else ""
            rates = (f"{perf['tokens_per_s']:.0f} tok/s  {perf['tflops_per_device']:.4g} TFLOPS/device  "
                     f"MFU {perf['mfu']:.2%}  all-to-all {perf['all_to_all_share']:.1%}") \
                if math.isfinite(perf["tokens_per_s"]) else f"not timed (the first {TIMING_WARMUP_STEPS} steps warm up)"
            logger.line(f"step {done}/{t.max_steps}  loss {last_train['nll']:.4f}  "
                        f"ppl {train_ppl:.2f}{balance}  this interval: {rates}")
        if eval_now:
            valid = evaluate(model, data.valid, r.eval_max_batches, env.device)
            logger.scalars(done, {"valid/ppl": valid["ppl"], **{f"valid_moe/{name}": value for name, value
                                                                  in valid.items() if name not in _EVAL_TOTALS}})
            logger.line(f"step {done}/{t.max_steps}  valid ppl {valid['ppl']:.2f}")
        if checkpoint_now:
            save_checkpoint(engine, run, done, env.rank, data.train, keep=r.keep_checkpoints)
        if stop:
            saved = f"checkpoint step{done:08d} written; resume with --resume" if checkpoint_now else \
                "this run writes no checkpoints (--checkpoint-interval 0), so it cannot be resumed"
            logger.line(f"stopped by {stop} after step {done}: {saved}")
            logger.close()
            _write_plots(run, env.rank)
            return {"stopped_by": stop, "steps": done}

    if not valid:   # resumed a run that had already finished
        valid = evaluate(model, data.valid, r.eval_max_batches, env.device)
    summary = _summary(config, env, data, last_train, valid, timer.total, peak, flops_per_step)
    peak_mib = torch.tensor([peak_rss_mib()], dtype=torch.float64, device=collective_device())
    dist.all_reduce(peak_mib, op=dist.ReduceOp.MAX)
    summary["peak_rss_mib_per_process"] = float(peak_mib)
    if env.rank == 0:
        write_json_atomic(run / "summary.json", summary)
        logger.line(summary_table(summary))
    logger.close()
    _write_plots(run, env.rank)
    return summary


def _write_plots(run, rank: int) -> None:
    """plots/ from the run's logs, drawn by rank 0 while the others wait, so every rank leaves together (a rank
    that exits while rank 0 is still busy can abort in gloo's teardown). A picture that cannot be drawn is a
    warning, never a failed run."""
    if rank == 0:
        from moe_scale.metrics.plots import write_run_plots

        try:
            write_run_plots(run)
        except Exception as e:   # noqa: BLE001 - after the training, nothing may fail the run
            print(f"moe-scale: warning: plots/ not written ({type(e).__name__}: {e})", file=sys.stderr)
    if dist.is_initialized():
        dist.barrier()


def _install_noise(model: torch.nn.Module, config: RunConfig, env: DistEnv) -> list[GlobalTokenNoise]:
    if config.train.noise_rng != "global":
        return []
    noises = []
    for index, layer in enumerate(model.moe_layers()):
        layer.router.noise_sampler = GlobalTokenNoise(config.train.seed, index, env.rank, env.world_size)
        noises.append(layer.router.noise_sampler)
    return noises


def _throughput(timed: dict, tokens_per_step: int, flops_per_step: float, world_size: int,
                peak_tflops: float) -> dict[str, float]:
    if not timed["steps"]:
        return {"tokens_per_s": float("nan"), "tflops_per_device": float("nan"), "mfu": float("nan"),
                "all_to_all_share": float("nan"), "step_seconds": float("nan")}
    step_seconds = timed["seconds"] / timed["steps"]
    tflops = tflops_per_device(flops_per_step, step_seconds, world_size)
    return {"tokens_per_s": tokens_per_step / step_seconds, "tflops_per_device": tflops, "step_seconds": step_seconds,
            **efficiency(tflops, peak_tflops, timed["all_to_all"], timed["seconds"])}


def _stop_if_diverged(record: dict, run, logger) -> None:
    """A non-finite loss or gradient norm ends the run before anything is written from the broken model: every
    rank reads the same (all-reduced) numbers, so all stop together."""
    values = {"loss": record["loss"], "aux loss": record["aux_loss"], "gradient norm": record["grad_norm"]}
    bad = [f"{name} {value}" for name, value in values.items() if value is not None and not math.isfinite(value)]
    if math.isfinite(record["loss"]) and record["loss"] > DIVERGED_LOSS:
        bad.append(f"loss {record['loss']:.3g} nats per token (past {DIVERGED_LOSS:g}: a uniform guess over a "
                   f"million words costs 14)")
    if not bad:
        return
    logger.close()
    from moe_scale.train.checkpoint import latest_complete_tag

    tag = latest_complete_tag(run)
    last = (f"the last complete checkpoint, {tag}, was written before it (a resume would take the same steps again: "
            f"start a new run with a lower --lr, with --overwrite or another --out)" if tag else
            "no checkpoint was written yet (start again with a lower --lr, with --overwrite or another --out)")
    raise UserError(f"training diverged at step {record['step']}: {', '.join(bad)}; stopped before writing a "
                    f"checkpoint of it; {last}")


def _exp(nll: float) -> float:
    return math.exp(nll) if nll < 700 else float("inf")


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto the device; to a GPU from pinned memory without waiting for the copy."""
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


def _peak(env: DistEnv, ds_config: dict) -> tuple[float, str]:
    """One device's peak, averaged over the ranks (each measures its share of a shared CPU)."""
    half = any(ds_config.get(key, {}).get("enabled") for key in ("bf16", "fp16"))
    peak, source = device_peak_tflops(env.device, half)
    peak_t = torch.tensor([peak], dtype=torch.float64, device=collective_device())
    dist.all_reduce(peak_t)
    return peak_t.item() / env.world_size, source


def _word_ppl(nll_per_token: float, data) -> float:
    """Training perplexity per word: exp(loss per token x the training text's tokens per word), 1 for words."""
    return _exp(nll_per_token * data.train.tokens_per_word)


def _summary(config, env, data, last_train, valid, timed, peak, flops_per_step) -> dict:
    perf = _throughput(timed, config.train.batch_size * config.data.seq_len, flops_per_step, env.world_size, peak[0])
    train_ppl = _word_ppl(last_train["nll"], data) if last_train else float("nan")
    train_moe = {name: value for name, value in last_train.items() if name not in ("nll", "aux_loss")}
    valid_moe = {f"valid_{name}": value for name, value in valid.items() if name not in _EVAL_TOTALS}
    return {
        "steps": config.train.max_steps,
        "world_size": env.world_size,
        "ep_size": config.parallel.ep_size,
        **({"gate": config.moe.router.gate} if config.has_moe_ffn else {}),
        "tokenizer": config.data.tokenizer if config.data.tokenizer in ("words", "bpe") else "file",
        "tokens_per_word": data.train.tokens_per_word,
        "train_ppl": train_ppl,
        "valid_ppl": valid["ppl"],
        "unigram_valid_ppl": data.unigram_valid_ppl(),
        "tokens_per_s": perf["tokens_per_s"],
        "tflops_per_device": perf["tflops_per_device"],
        "step_seconds": perf["step_seconds"],
        "mfu": perf["mfu"],
        "peak_tflops_per_device": peak[0],
        "peak_source": peak[1],
        "all_to_all_share": perf["all_to_all_share"],
        **train_moe,
        **valid_moe,
    }
