"""What a run reports, on rank 0: TensorBoard scalars, a per-step JSON log, progress on the console.

On a terminal a progress bar; otherwise (SLURM logs, pipes) one plain line per logging interval.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from moe_scale.files import write_text_atomic
from moe_scale.run_files import RunFiles
from tqdm import tqdm

EXPERT_LOAD_LOG = RunFiles.EXPERT_LOAD


class RunLogger:
    def __init__(self, run: Path, total_steps: int, start_step: int, enabled: bool):
        """`start_step` > 0 (a resume): what was logged after that step, by the run that stopped after its last
        checkpoint, is dropped, so train_log.jsonl and TensorBoard hold every step once, in order;
        `resumed_records` keeps what was logged up to it."""
        self.enabled = enabled
        self.resumed_records: list[dict] = []
        if not enabled:
            return
        self.tb = SummaryWriter(str(RunFiles(run).tb), purge_step=start_step + 1 if start_step else None)
        log, loads = RunFiles(run).train_log, RunFiles(run).expert_load
        if start_step and log.exists():
            self.resumed_records = _records_up_to(log, start_step)
            write_text_atomic(log, "".join(json.dumps(r) + "\n" for r in self.resumed_records))
        elif not start_step:
            log.unlink(missing_ok=True)
        if start_step and loads.exists():
            write_text_atomic(loads, "".join(json.dumps(r) + "\n" for r in _records_up_to(loads, start_step)))
        elif not start_step:
            loads.unlink(missing_ok=True)
        self.step_log, self.load_log = log.open("a"), None
        self._loads_path = loads
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=not sys.stdout.isatty())

    def step(self, record: dict) -> None:
        """Every optimizer step: one JSON line (the record of what was trained) and the progress bar."""
        if not self.enabled:
            return
        self.step_log.write(json.dumps(record) + "\n")
        self.step_log.flush()
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        for tag, value in values.items():
            self.tb.add_scalar(tag, value, step)
        self.tb.flush()

    def expert_loads(self, step: int, relative_loads: list) -> None:
        """Every logging interval: each MoE layer's per-expert load / mean load, one JSON line (for the heatmaps
        in plots/) and a TensorBoard histogram per layer."""
        if not self.enabled or not relative_loads:
            return
        if self.load_log is None:
            self.load_log = self._loads_path.open("a")
        layers = [[round(float(x), 3) for x in load.tolist()] for load in relative_loads]
        self.load_log.write(json.dumps({"step": step, "layers": layers}) + "\n")
        self.load_log.flush()
        for index, load in enumerate(relative_loads):
            self.tb.add_histogram(f"moe/load_over_mean/layer{index}", load, step)

    def line(self, text: str) -> None:
        """A log line: above the bar on a terminal, plain otherwise."""
        if self.enabled:
            (self.bar.write if not self.bar.disable else print)(text, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.tb.close()
            self.step_log.close()
            if self.load_log is not None:
                self.load_log.close()


def _records_up_to(log: Path, step: int) -> list[dict]:
    records = []
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:   # a line cut short by a kill
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            records.append(record)
    return records


def summary_table(summary: dict) -> str:
    rows = [(key, f"{value:.4g}" if isinstance(value, float) else str(value)) for key, value in summary.items()]
    width = max(len(key) for key, _ in rows)
    rule = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([rule, *(f"{key:<{width}}   {value}" for key, value in rows), rule])
