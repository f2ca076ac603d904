"""What the training loop's steps and report points share: built once by run_training, never changed by a step
(what a step changes is the TrainState, train/state.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_scale.config import RunConfig
from moe_scale.distributed.launch import DistEnv
from moe_scale.moe.route_tape import RouteTape
from moe_scale.moe.router import GlobalTokenNoise, Router
from moe_scale.train.busy_machine import BusyMachineNotice
from moe_scale.train.data_setup import LMData
from moe_scale.train.engine import TrainingEngine
from moe_scale.train.mae_bcd import MAEBlockCoordinateDescent
from moe_scale.train.preemption import StopRequests


@dataclass
class TrainContext:
    config: RunConfig
    env: DistEnv
    data: LMData
    model: torch.nn.Module
    trainer: TrainingEngine
    noises: list[GlobalTokenNoise]            # --noise-rng global: the gates' samplers, told each step
    mae: MAEBlockCoordinateDescent | None     # --attention mae with --mae-training bcd: the G steps
    run: Path
    ds_config: dict
    stop_requests: StopRequests
    balancers: list[Router] = field(default_factory=list)   # gates told of each step (aux_free's routing biases)
    tape: RouteTape | None = None   # --record-routes / --replay-routes (moe/route_tape.py)
    busy_notice: BusyMachineNotice | None = None   # a CPU run slowed by other processes says so (busy_machine.py)
