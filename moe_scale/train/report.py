"""What a training run reports: each step's numbers, kept on the device until a log, eval or checkpoint point
reads them in one copy; at a log point the interval's loss, perplexity per word, MoE balance and throughput
(tokens/s, TFLOPS, MFU, the all-to-all share); at an eval point the validation pass; at the end the summary.
Every rank takes part (the numbers are all-reduced, a divergence stops all ranks together); rank 0 writes.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from moe_scale.accounting.flops import tflops_per_device, training_flops_per_token
from moe_scale.accounting.model_flops import forward_macs_per_token
from moe_scale.distributed.comm import collective_device
from moe_scale.distributed.launch import DistEnv, ranks_per_node
from moe_scale.errors import UserError
from moe_scale.files import write_json_atomic
from moe_scale.metrics.balance import MeanTracker, MoEMetrics, overload_text
from moe_scale.metrics.logging import RunLogger, summary_table
from moe_scale.metrics.perf import (all_to_all_seconds, device_peak_tflops, efficiency, peak_rss_mib,
                                    raised_peak)
from moe_scale.models.build import describe_parameters
from moe_scale.run_files import RunFiles
from moe_scale.train.context import TrainContext
from moe_scale.train.evaluate import evaluate
from moe_scale.train.state import TrainState
from moe_scale.train.step_stats import PendingSteps, StepTimer

_EVAL_TOTALS = ("ppl", "nll_per_token", "tokens", "words_predicted")
DIVERGED_LOSS = 1000.0     # nats per token: no model that still learns gets anywhere near it
TIMING_WARMUP_STEPS = 3   # first steps pay for allocation and DeepSpeed's lazy setup; not counted in tokens/s


class RunReport:
    def __init__(self, ctx: TrainContext, state: TrainState):
        """Opens the run's logs at `state`'s step (a resume drops what was logged after it) and says what trains."""
        config, env, data, model = ctx.config, ctx.env, ctx.data, ctx.model
        self.ctx = ctx
        self.logger = RunLogger(ctx.run, state.max_steps, state.step, enabled=env.rank == 0)
        self.flops_per_step = training_flops_per_token(
            {**forward_macs_per_token(config, len(data.vocab), config.data.seq_len),
             "softmax": model.softmax.forward_macs_per_token()}) * config.train.batch_size * config.data.seq_len
        self.interval, self.interval_moe = MeanTracker(), MoEMetrics(model.moe_layers(), router_load=True)
        interval_start = state.step - state.step % config.run.log_interval
        for record in self.logger.resumed_records:   # a resume mid-interval: the interval's earlier steps count too
            if record["step"] > interval_start:
                self.interval.add({"nll": record["loss"], "aux_loss": record["aux_loss"]})
        self.pending = PendingSteps()   # each step's numbers stay on the device until a log, eval or checkpoint point
        self.timer = StepTimer(env.device, lambda: all_to_all_seconds(model.moe_layers()))
        # what the peak depends on besides the device: kept for the end's check of a measured peak
        self.half_precision = any(ctx.ds_config.get(key, {}).get("enabled") for key in ("bf16", "fp16"))
        self.ranks_on_machine = _ranks_on_machine(env)
        self.peak = _peak(env, self.half_precision, self.ranks_on_machine)
        self.last_train, self.valid, self.last_record = {}, {}, {}
        self.logger.line(f"training {describe_parameters(model)} on {env.world_size} process(es), "
                         f"ep_size={config.parallel.ep_size}{_etp_text(config)}, {data.train.describe()}; MFU "
                         f"against a peak of "
                         f"{self.peak[0]:.4g} TFLOPS per device ({self.peak[1]})")
        if config.data.tokenizer != "words":
            self.logger.line(f"tokenizer {config.data.tokenizer}: {len(data.vocab)} tokens, "
                             f"{data.train.tokens_per_word:.3f} per word of the training text; perplexities are "
                             f"per word (exp(total NLL / words))")

    def step_begins(self, state: TrainState) -> None:
        if state.steps_this_run >= TIMING_WARMUP_STEPS:   # the first steps pay for allocation and lazy setup
            self.timer.start()

    def forward_done(self) -> None:
        """A micro-batch's forward: its layers' routing joins the interval's balance numbers (device additions)."""
        self.interval_moe.add()

    def step_done(self, done: int, lr: float, sums_3: torch.Tensor, grad_norm) -> None:
        """`sums_3`: the step's [NLL sum, tokens, aux sum] over all ranks, left on the device."""
        self.pending.add(done, lr, sums_3, grad_norm)
        self.timer.step_done()

    def read_steps(self) -> None:
        """At any point: the pending steps' numbers to the host in one copy, into the step log; a diverged step
        ends the run here, before anything is evaluated or saved from the broken model."""
        self.timer.stop()
        config = self.ctx.config
        for record in self.pending.flush(self.ctx.env.world_size * config.train.grad_accum):
            self.logger.step(record)
            _stop_if_diverged(record, self.ctx.run, self.logger)
            self.interval.add({"nll": record["loss"], "aux_loss": record["aux_loss"]})
            self.last_record = record

    def log_point(self, state: TrainState) -> None:
        """The interval's means, expert loads and throughput: TensorBoard and one line."""
        self.last_train = {**self.interval.means(), **self.interval_moe.values()}
        last_train, done = self.last_train, state.step
        self.logger.expert_loads(done, self.interval_moe.relative_loads())
        self.interval.reset()
        self.interval_moe.reset()
        perf = self.last_perf = self._throughput(self.timer.take_interval(), state)
        train_ppl = _word_ppl(last_train["nll"], self.ctx.data)
        self.logger.scalars(done, {"train/loss": last_train["nll"], "train/ppl": train_ppl,
                                   "train/aux_loss": last_train["aux_loss"], "train/lr": self.last_record["lr"],
                                   **{f"moe/{name}": value for name, value in last_train.items()
                                      if name not in ("nll", "aux_loss")},
                                   "perf/tokens_per_s": perf["tokens_per_s"],
                                   "perf/tflops_per_device": perf["tflops_per_device"],
                                   "perf/mfu": perf["mfu"], "perf/all_to_all_share": perf["all_to_all_share"]})
        balance = overload_text(last_train)
        rates = (f"{perf['tokens_per_s']:.0f} tok/s  {perf['tflops_per_device']:.4g} TFLOPS/device  "
                 f"MFU {perf['mfu']:.2%}  all-to-all {perf['all_to_all_share']:.1%}") \
            if math.isfinite(perf["tokens_per_s"]) else f"not timed (the first {TIMING_WARMUP_STEPS} steps warm up)"
        self.logger.line(f"step {done}/{state.max_steps}  loss {last_train['nll']:.4f}  "
                         f"ppl {train_ppl:.2f}{balance}  this interval: {rates}")

    def eval_point(self, state: TrainState) -> None:
        """A validation pass: TensorBoard and one line."""
        self._evaluate()
        self.logger.scalars(state.step, {"valid/ppl": self.valid["ppl"],
                                         **{f"valid_moe/{name}": value for name, value in self.valid.items()
                                            if name not in _EVAL_TOTALS}})
        self.logger.line(f"step {state.step}/{state.max_steps}  valid ppl {self.valid['ppl']:.2f}")

    def _evaluate(self) -> None:
        ctx = self.ctx
        self.valid = evaluate(ctx.model, ctx.data.valid, ctx.config.run.eval_max_batches, ctx.env.device)

    def stopped(self, by: str, state: TrainState, checkpointed: bool) -> None:
        saved = f"checkpoint step{state.step:08d} written; resume with --resume" if checkpointed else \
            "this run writes no checkpoints (--checkpoint-interval 0), so it cannot be resumed"
        self.logger.line(f"stopped by {by} after step {state.step}: {saved}")
        self.logger.close()

    def finish(self, state: TrainState) -> dict:
        """The summary (summary.json and a table), after a validation pass if the run took none (it resumed a run
        stopped after its last checkpoint, before its summary)."""
        if not self.valid:
            self._evaluate()
        summary = self._summary(state)
        peak_mib = torch.tensor([peak_rss_mib()], dtype=torch.float64, device=collective_device())
        dist.all_reduce(peak_mib, op=dist.ReduceOp.MAX)
        summary["peak_rss_mib_per_process"] = float(peak_mib)
        if self.ctx.env.rank == 0:
            write_json_atomic(RunFiles(self.ctx.run).summary, summary)
            self.logger.line(summary_table(summary))
        self.logger.close()
        return summary

    def _throughput(self, timed: dict, state: TrainState) -> dict[str, float]:
        if not timed["steps"]:
            return {"tokens_per_s": float("nan"), "tflops_per_device": float("nan"), "mfu": float("nan"),
                    "all_to_all_share": float("nan"), "step_seconds": float("nan")}
        step_seconds = timed["seconds"] / timed["steps"]
        tflops = tflops_per_device(self.flops_per_step, step_seconds, self.ctx.env.world_size)
        raised = raised_peak(self.ctx.env.device, self.half_precision, self.ranks_on_machine, self.peak[0], tflops,
                             store=self.ctx.env.rank == 0)
        if raised is not None:   # never an MFU over 100%: the run's own rate is the better peak
            self.peak = raised
            if self.ctx.env.rank == 0:
                print(f"moe-scale: note: the peak is now {raised[0]:.4g} TFLOPS per device, {raised[1]}",
                      file=sys.stderr, flush=True)
        return {"tokens_per_s": state.tokens_per_step / step_seconds, "tflops_per_device": tflops,
                "step_seconds": step_seconds,
                **efficiency(tflops, self.peak[0], timed["all_to_all"], timed["seconds"])}

    def _summary(self, state: TrainState) -> dict:
        config, data, last_train, valid = self.ctx.config, self.ctx.data, self.last_train, self.valid
        perf = self._throughput(self.timer.total, state)
        train_ppl = _word_ppl(last_train["nll"], data) if last_train else float("nan")
        train_moe = {name: value for name, value in last_train.items() if name not in ("nll", "aux_loss")}
        valid_moe = {f"valid_{name}": value for name, value in valid.items() if name not in _EVAL_TOTALS}
        return {
            "steps": state.max_steps,
            "world_size": self.ctx.env.world_size,
            "ep_size": config.parallel.ep_size,
            **({"etp_size": config.etp_size} if config.etp_size > 1 else {}),
            **({"gate": config.moe.router.gate} if config.has_moe_ffn else {}),
            **({"force_balanced_routing": True} if config.has_moe_ffn and config.moe.router.force_balanced_routing
               else {}),
            "tokenizer": config.data.tokenizer if config.data.tokenizer in ("words", "bpe") else "file",
            "tokens_per_word": data.train.tokens_per_word,
            "train_ppl": train_ppl,
            "valid_ppl": valid["ppl"],
            "unigram_valid_ppl": data.unigram_valid_ppl(),
            "tokens_per_s": perf["tokens_per_s"],
            "tflops_per_device": perf["tflops_per_device"],
            "step_seconds": perf["step_seconds"],
            "mfu": perf["mfu"],
            "peak_tflops_per_device": self.peak[0],
            "peak_source": self.peak[1],
            "all_to_all_share": perf["all_to_all_share"],
            **train_moe,
            **valid_moe,
        }


def _etp_text(config) -> str:
    return f", etp_size={config.etp_size}" if config.etp_size > 1 else ""


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


def _ranks_on_machine(env: DistEnv) -> int:
    try:
        return ranks_per_node(0)
    except ValueError:   # no launcher said: all ranks count as one machine's
        return env.world_size


def _peak(env: DistEnv, half: bool, on_machine: int) -> tuple[float, str]:
    """One device's peak, averaged over the ranks (each measures its share of a shared CPU, all at once, unless
    every rank finds its measurement cached)."""
    def all_found(found: bool) -> bool:
        flag = torch.tensor([1.0 if found else 0.0], dtype=torch.float64, device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    peak, source = device_peak_tflops(env.device, half, on_machine, all_found)
    peak_t = torch.tensor([peak], dtype=torch.float64, device=collective_device())
    dist.all_reduce(peak_t)
    return peak_t.item() / env.world_size, source


def _word_ppl(nll_per_token: float, data) -> float:
    """Training perplexity per word: exp(loss per token x the training text's tokens per word), 1 for words."""
    return _exp(nll_per_token * data.train.tokens_per_word)
