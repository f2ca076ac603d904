"""What the training loop changes from step to step, in one place, and how much of it a checkpoint holds.

The schedule (`max_steps`) is the config's, or `--token-budget`'s number of steps, shortened when a streamed pass
ends first; the config itself is never changed. Every random stream of a step is a function of (seed, step,
rank), and an in-memory source's position a function of the step, so a checkpoint holds the step (DeepSpeed's
client state, `{"step": N}`) and, for a source with a position of its own (`--stream`), that position.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_scale.config import RunConfig


@dataclass
class TrainState:
    """The run after `step` optimizer steps; `step_done` moves it on by one."""

    seed: int
    tokens_per_step: int                # global batch x sequence length
    max_steps: int                      # the run ends after this step
    step: int = 0                       # optimizer steps done
    start_step: int = 0                 # the step this process began at (a resume: its checkpoint's)
    data_position: dict | None = None   # the training source's own position after `step` (None: `step` is all)

    @classmethod
    def planned(cls, config: RunConfig, data_position: dict | None) -> TrainState:
        """Step 0 of a run of `config`: --token-budget, where given, sets the number of steps (rounded up)."""
        tokens_per_step = config.train.batch_size * config.data.seq_len
        budget = config.data.token_budget if config.data.stream else 0
        return cls(seed=config.train.seed, tokens_per_step=tokens_per_step,
                   max_steps=-(-budget // tokens_per_step) if budget else config.train.max_steps,
                   data_position=data_position)

    @property
    def steps_this_run(self) -> int:
        """Steps this process has trained (a resumed run's earlier ones not counted)."""
        return self.step - self.start_step

    def step_seed(self, rank: int) -> int:
        """The seed of every random stream of the next step (dropout, gate noise, sampled softmax) on `rank`."""
        return ((self.seed * 1_000_003 + self.step) * 65_537 + rank) % (2**63)

    def step_done(self, data_position: dict | None) -> None:
        self.step += 1
        self.data_position = data_position

    def end_with_the_data(self, last_step: int) -> None:
        """The training data has no batch after `last_step`: the run ends after it."""
        self.max_steps = last_step + 1

    def client_state(self) -> dict:
        """What DeepSpeed's checkpoint keeps of the state (the format of every checkpoint so far)."""
        return {"step": self.step}

    def resume(self, step: int, data_position: dict | None) -> None:
        """Continue after `step`, where a checkpoint left the run."""
        self.step = self.start_step = step
        self.data_position = data_position
