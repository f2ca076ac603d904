"""One training run: check inputs, build data, model and DeepSpeed engine, loop, evaluate, checkpoint, summarise.

Every random stream is a function of (seed, step, rank), and the data position a function of the step (or, for a
streamed source, saved with the step: train/state.py), so a resumed run repeats an uninterrupted one exactly, and
`--noise-rng global` with dropout 0 makes runs with different world sizes on the same global batch take the
same steps.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_scale.config import RunConfig
from moe_scale.distributed.comm import collective_device
from moe_scale.distributed.launch import DistEnv, init_distributed, ranks_per_node
from moe_scale.errors import UserError
from moe_scale.models.build import build_model
from moe_scale.moe.router import GlobalTokenNoise, Router
from moe_scale.run_files import RunFiles
from moe_scale.train.memory_check import check_model_fits
from moe_scale.train.busy_machine import BusyMachineNotice
from moe_scale.train.checkpoint import checkpoint_to_resume, load_checkpoint, save_checkpoint
from moe_scale.data.fingerprint import DATA_FILES, check_resumed_data, fingerprint, read_record
from moe_scale.data.source import TrainingSource
from moe_scale.data.subwords import save_run_tokenizer
from moe_scale.train.context import TrainContext
from moe_scale.train.data_setup import build_lm_data
from moe_scale.layout.ds_config import complete_ds_config, load_ds_config
from moe_scale.train.engine import TrainingEngine
from moe_scale.layout.checks import check_run_layout, check_world_layout
from moe_scale.train.mae_bcd import mae_schedule
from moe_scale.files import write_json_atomic
from moe_scale.train.report import RunReport
from moe_scale.train.run_dir import check_run_dir, claim_run_dir
from moe_scale.train.preemption import StopRequests
from moe_scale.moe.route_tape import RouteTape, open_tape
from moe_scale.train.state import TrainState
from moe_scale.train.upcycle import dense_run_to_upcycle, upcycle


def run_training(config: RunConfig) -> dict:
    """Builds the run (every input checked before the run directory is touched: a bad flag leaves nothing
    half-written), then trains it; `config` is left as it was given."""
    config.validate()
    t, run_dir, ep_size = config.train, config.run, config.expert_ranks   # --ep-size x --etp-size
    ds_source = f"--ds-config {config.parallel.ds_config or '(built-in)'}"
    user_ds_config = load_ds_config(config.parallel.ds_config)
    check_run_layout(config, user_ds_config, ds_source)   # the checks `moe-scale plan` shares (layout/checks.py)
    run = check_run_dir(run_dir.out, run_dir.resume, run_dir.overwrite, run_dir.resume_from)
    env = init_distributed()
    micro_batch = check_world_layout(config, env.world_size, lambda: ranks_per_node(config.moe.dispatch.node_size))
    resume_tag = checkpoint_to_resume(run, run_dir.resume_from, config) if run_dir.resume else None   # files verified
    ds_config = complete_ds_config(user_ds_config, micro_batch, t.grad_accum, env.world_size, ds_source)
    data_record = fingerprint(config.data)
    saved_record = read_record(run) if run_dir.resume else None
    changed = check_resumed_data(saved_record, data_record, run_dir.accept_changed_data)
    upcycled = dense_run_to_upcycle(config) if t.upcycle_from and not run_dir.resume else None
    data = build_lm_data(config.data, env, global_rows=t.batch_size, seed=t.seed,
                         saved_run=run if run_dir.resume else upcycled[0] if upcycled else None)

    if env.device.type == "cuda":   # float32 products on TF32 tensor cores (bf16 runs are unaffected)
        torch.set_float32_matmul_precision("high")
    def build():
        return build_model(config, len(data.vocab), ep_size=ep_size, ep_rank=env.rank % ep_size, seed=t.seed,
                           counts=data.vocab.counts, world=env.world_size, rank=env.rank)

    check_model_fits(build, ds_config, t.optimizer, env.world_size, ep_size, env.device)   # on the meta device
    torch.manual_seed(t.seed)
    model = build()
    if upcycled:
        upcycle(model, *upcycled, noise=t.upcycle_noise, seed=t.seed)
        if env.rank == 0:
            print(f"upcycled from {upcycled[0]} (checkpoint {upcycled[1]}): every expert a copy of its FFN"
                  + (f" with {t.upcycle_noise:g} noise" if t.upcycle_noise else "") + ", a new router", flush=True)
    if t.init_from_hf and not run_dir.resume:   # a resumed run's weights are its checkpoint's
        from moe_scale.weights.hf_native import init_from_hf

        init_from_hf(model, config, data.vocab)
    mae = mae_schedule(model, config, data.train.steps_per_epoch)   # MAE's G steps, else None
    trainer = TrainingEngine(model.to(env.device), ds_config, t)
    noises = _install_noise(model, config, env)
    state = TrainState.planned(config, data.train.state_dict())
    tape = _route_tape(config, model, env, data_record)
    if run_dir.resume:
        load_checkpoint(trainer.engine, run, resume_tag, state, data.train)
        _check_steps_left(config, run, state, data.train, resume_tag)
    # Only now, with every input checked and the engine built, does the run directory change.
    lock = claim_run_dir(run, run_dir.resume, run_dir.overwrite) if env.rank == 0 else None
    try:
        if env.rank == 0:
            save_run_tokenizer(data.vocab, run)
            _record_data(run, data_record, saved_record, changed, state.step)
            _as_planned(config, state).save(RunFiles(run).config)
            write_json_atomic(RunFiles(run).ds_config, ds_config)
        dist.barrier()
        stop_requests = StopRequests()   # collective: every rank
        try:
            return _train(TrainContext(config, env, data, model, trainer, noises, mae, run, ds_config, stop_requests,
                                       balancers=_balancers(model), tape=tape), state)
        finally:
            stop_requests.restore()
    finally:
        if lock is not None:
            lock.release()


def _route_tape(config: RunConfig, model, env, data_record: dict) -> RouteTape | None:
    """--record-routes / --replay-routes: the tape on the model's routed layers, or None."""
    data_sig = {"train": [[f["bytes"], f["crc32"]] for f in data_record["splits"].get("train", [])],
                "seed": config.train.seed, "batch_size": config.train.batch_size, "seq_len": config.data.seq_len,
                "grad_accum": config.train.grad_accum}
    return open_tape(model.moe_layers(), config.moe.router.gate, config.run.record_routes, config.run.replay_routes,
                     env.rank, env.world_size, data_sig)


def _check_steps_left(config: RunConfig, run: Path, state: TrainState, source: TrainingSource, tag: str) -> None:
    """A resume of a finished run (nothing left to train: its schedule, or its streamed pass, is done, and its
    summary is written) is refused before the run directory is touched: its summary, logs and plots are its
    results. A run stopped after its last checkpoint but before its summary (killed) resumes to write it."""
    if source.last_step is not None:   # a streamed pass that ended: no batch after it
        state.end_with_the_data(source.last_step)
    if state.step < state.max_steps or not _summarised(run, state.max_steps):
        return
    if source.last_step is not None and state.max_steps == source.last_step + 1:
        more = "its streamed training data ended there (one pass over --data); start a new run to train on more data"
    elif config.data.stream and config.data.token_budget:
        more = "pass a larger --token-budget with --resume to train on"
    else:
        more = "pass a larger --max-steps with --resume to train on"
    raise UserError(f"--resume: the run in {run} has finished (checkpoint {tag} is after step {state.step} of "
                    f"{state.max_steps}), so there is nothing to train and its results stay as they are; {more}, "
                    f"or start a new run with another --out")


def _summarised(run: Path, steps: int) -> bool:
    """Whether the run wrote its summary after its last step."""
    try:
        summary = json.loads(RunFiles(run).summary.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("steps") == steps


def _record_data(run: Path, record: dict, previous: dict | None, changed: list[str], step: int) -> None:
    """data_files.json: the files this run trains on; a resume that accepted changed data says so, in the log and
    in the record's history."""
    accepted = (previous or {}).get("accepted", [])
    if changed:
        print(f"moe-scale: resuming at step {step} on changed data (--accept-changed-data): {'; '.join(changed)}",
              flush=True)
        accepted = [*accepted, {"step": step, "changes": changed}]
    write_json_atomic(run / DATA_FILES, {**record, **({"accepted": accepted} if accepted else {})})


def _as_planned(config: RunConfig, state: TrainState) -> RunConfig:
    """What config.json records: the run's settings with the steps it plans (--token-budget's, where given); a
    resume's consent to changed data is recorded in data_files.json, not carried to the next resume."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=state.max_steps),
                               run=dataclasses.replace(config.run, accept_changed_data=False))


def _train(ctx: TrainContext, state: TrainState) -> dict:
    """The steps from the state's to the end of its schedule, each followed by its points (_points); the summary,
    or what stopped the run early."""
    report = RunReport(ctx, state)
    ctx.busy_notice = BusyMachineNotice(ctx.env.device, report.peak[0], report.peak[1].startswith("measured"))
    while state.step < state.max_steps:
        _step(ctx, state, report)
        stop = ctx.stop_requests.agreed()   # SIGTERM / SIGINT / SIGUSR1 on any rank: checkpoint and stop
        if _points(ctx, state, report, stop):
            _write_plots(ctx)
            return {"stopped_by": stop, "steps": state.step}
    ctx.stop_requests.end_listening()
    summary = report.finish(state)
    _write_plots(ctx)
    return summary


def _step(ctx: TrainContext, state: TrainState, report: RunReport) -> None:
    """One optimizer step: its random streams, its batch, MAE's G step, forward and backward over the
    micro-batches; the step's sums, all-reduced, stay on the device for the report."""
    t, env, source, step = ctx.config.train, ctx.env, ctx.data.train, state.step
    torch.manual_seed(state.step_seed(env.rank))
    for noise in ctx.noises:
        noise.set_step(step)
    inputs, targets = source.batch(step, shuffle_seed=state.seed)
    if source.last_step == step:
        state.end_with_the_data(step)
        report.logger.line(f"the streamed training data ends at step {step + 1}: the last step of this pass")
    report.step_begins(state)
    if ctx.mae is not None:
        ctx.mae.g_step_if_due(step, inputs, targets, env.device)
    engine = ctx.trainer.engine
    for router in ctx.balancers:   # their load counts this step's micro-batches only
        router.begin_step()
    sums = torch.zeros(3, dtype=torch.float64, device=collective_device())   # [NLL sum, tokens, aux sum]
    for micro, (micro_inputs, micro_targets) in enumerate(zip(inputs.chunk(t.grad_accum),
                                                              targets.chunk(t.grad_accum))):
        if ctx.tape is not None:
            ctx.tape.at("train", step, micro)
        out = engine(to_device(micro_inputs, env.device), to_device(micro_targets, env.device))
        if ctx.tape is not None:
            ctx.tape.clear()
        report.forward_done()   # every micro-batch's routing counts, before a recompute in backward re-runs it
        ctx.trainer.backward_and_step(out.nll_sum / out.num_tokens + out.aux_loss)
        sums += torch.stack([out.nll_sum.detach().double(), out.nll_sum.new_full((), out.num_tokens).double(),
                             out.aux_loss.detach().double()]).to(sums.device)
    for router in ctx.balancers:   # after the optimizer step, from the step's load over all ranks (on the device)
        router.after_step()
    if ctx.tape is not None:
        ctx.tape.flush()   # recording: the step's routes to disk (one copy to the host)
    dist.all_reduce(sums)
    report.step_done(step + 1, engine.get_lr()[0], sums, ctx.trainer.grad_norm)
    state.step_done(source.state_dict())


def _points(ctx: TrainContext, state: TrainState, report: RunReport, stop: str | None) -> bool:
    """After a step: the log, eval and checkpoint points its intervals, the end of the schedule or a stop request
    put there; True where the run stops."""
    r, done = ctx.config.run, state.step
    log_now = done % r.log_interval == 0 or done == state.max_steps or stop
    eval_now = done % r.eval_interval == 0 or done == state.max_steps
    checkpoint_now = r.checkpoint_interval > 0 and (done % r.checkpoint_interval == 0 or done == state.max_steps
                                                      or stop)
    if not (log_now or eval_now or checkpoint_now):
        return False
    report.read_steps()
    if log_now:
        report.log_point(state)
        busy = ctx.busy_notice.check(report.last_perf["tokens_per_s"]) if ctx.busy_notice and ctx.env.rank == 0 \
            else None
        if busy:
            print(busy, file=sys.stderr, flush=True)
    if eval_now:
        report.eval_point(state)
    if checkpoint_now:
        save_checkpoint(ctx.trainer.engine, ctx.run, state, ctx.env.rank, rows=ctx.data.train.row_layout,
                        keep=r.keep_checkpoints)
    if stop:
        report.stopped(stop, state, bool(checkpoint_now))
    return bool(stop)


def _write_plots(ctx: TrainContext) -> None:
    """plots/ from the run's logs, drawn by rank 0 while the others wait, so every rank leaves together (a rank
    that exits while rank 0 is still busy can abort in gloo's teardown). A picture that cannot be drawn is a
    warning, never a failed run."""
    if ctx.env.rank == 0:
        from moe_scale.metrics.plots import write_run_plots

        try:
            write_run_plots(ctx.run, ctx.data.train.tokens_per_word)
        except Exception as e:   # noqa: BLE001 - after the training, nothing may fail the run
            print(f"moe-scale: warning: plots/ not written ({type(e).__name__}: {e})", file=sys.stderr)
    if dist.is_initialized():
        dist.barrier()


def _balancers(model: torch.nn.Module) -> list[Router]:
    """The gates that update themselves between optimizer steps (aux_free's routing biases)."""
    return [m for m in model.modules() if isinstance(m, Router) and m.balances_after_step]


def _install_noise(model: torch.nn.Module, config: RunConfig, env: DistEnv) -> list[GlobalTokenNoise]:
    if config.train.noise_rng != "global":
        return []
    noises = []
    for index, layer in enumerate(model.moe_layers()):
        layer.router.noise_sampler = GlobalTokenNoise(config.train.seed, index, env.rank, env.world_size)
        noises.append(layer.router.noise_sampler)
    return noises


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto the device; to a GPU from pinned memory without waiting for the copy."""
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)
