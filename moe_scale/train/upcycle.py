"""Sparse upcycling (Komatsuzaki et al. 2022): an MoE run that starts from a trained dense run.

Legend (docs/shapes.md): D model width, F expert hidden width.

Every expert starts as a copy of the dense run's feed-forward network (optionally each with its own small
multiplicative noise, `--upcycle-noise`), the router is new, and every other weight (embedding, LSTMs or attention,
norms, softmax) is the dense run's. The experts compute `scale · W_out relu(W_in x)` (moe/experts/ffn.py), the dense
FFN `W_out relu(W_in x)`, so W_out is copied divided by the experts' output scale: an expert's output equals the
dense FFN's, and with gates that sum to 1 (noisy top-k, hierarchical) the upcycled model's output equals the dense
model's at step 0. The run reuses the dense run's tokenizer, so the ids mean the same words.

Pairs: the LSTM LM `lstm-ffn-lstm` with one hidden layer (MoE-1-Deep's dense "expert") -> `lstm-moe-lstm`. The
transformer's dense FFN (GELU, with biases) has no expert of the same function (ReLU, no biases): refused, as is any
pair whose shared weights differ in shape.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_scale.config import RunConfig
from moe_scale.deepspeed_internals import MODEL_STATES_FILE
from moe_scale.errors import UserError

# Settings the copied weights' shapes (and meaning) depend on: they must be the dense run's.
_SHARED = ("d_model", "lstm_hidden", "expert_hidden", "vocab_size", "tokenizer", "min_count", "softmax",
           "adaptive_cutoffs")
_FFN_PREFIX = "ffn."


def dense_run_to_upcycle(config: RunConfig) -> tuple[Path, str]:
    """(run, checkpoint tag) of --upcycle-from, checked: a finished dense run whose shapes fit this MoE model."""
    from moe_scale.train.checkpoint import choose_checkpoint

    run = Path(config.train.upcycle_from)
    flag = f"--upcycle-from {run}"
    if not (run / "config.json").is_file() or not (run / "checkpoints").is_dir():
        raise UserError(f"{flag}: no trained run there (config.json and a complete checkpoint are needed); pass the "
                        f"--out directory of a finished dense `moe-scale train`")
    dense = RunConfig.load(run / "config.json")
    _check_pair(config, dense, flag)
    tag, _ = choose_checkpoint(run, None, "--upcycle-from", dense)
    return run, tag


def _check_pair(config: RunConfig, dense: RunConfig, flag: str) -> None:
    if config.model.kind == "transformer" or dense.model.kind == "transformer":
        raise UserError(f"{flag}: upcycling copies a dense FFN into experts of the same function, and the "
                        f"transformer's dense FFN (GELU, with biases) has none among the experts (ReLU, no biases); "
                        f"upcycle an LSTM run (--layout lstm-ffn-lstm --ffn-layers 1)")
    if dense.model.lstm.layout != "lstm-ffn-lstm" or dense.model.lstm.ffn_layers != 1:
        raise UserError(f"{flag}: it is a --layout {dense.model.lstm.layout} run"
                        + (f" with --ffn-layers {dense.model.lstm.ffn_layers}"
                           if dense.model.lstm.layout == "lstm-ffn-lstm" else "")
                        + "; upcycling needs a dense FFN of one hidden layer, as each expert has: a --layout "
                          "lstm-ffn-lstm --ffn-layers 1 run")
    if config.model.lstm.layout != "lstm-moe-lstm":
        raise UserError(f"{flag}: this run is --layout {config.model.lstm.layout}, which has no experts to start "
                        f"from the dense FFN; pass --layout lstm-moe-lstm")
    leaves = RunConfig.leaves()
    for key in _SHARED:
        if config.get(key) != dense.get(key):
            raise UserError(f"{flag}: it was trained with {leaves[key].flag} {dense.get(key)}, this run asks for "
                            f"{config.get(key)}; the copied weights need the dense run's: pass "
                            f"{leaves[key].flag} {dense.get(key)}")


def upcycle(model: torch.nn.Module, run: Path, tag: str, noise: float, seed: int) -> None:
    """Loads the dense run's weights into `model` (an LSTM-MoE built from the paired config): the FFN into
    every expert this process holds, the rest by name; the router keeps its fresh initialisation."""
    state = torch.load(run / "checkpoints" / tag / MODEL_STATES_FILE, map_location="cpu", weights_only=False)["module"]
    ffn = {name[len(_FFN_PREFIX):]: value for name, value in state.items() if name.startswith(_FFN_PREFIX)}
    rest = {name: value for name, value in state.items() if not name.startswith(_FFN_PREFIX)}
    missing = set(model.state_dict()) - set(rest)
    if any(not name.startswith("moe.") for name in missing) or set(rest) - set(model.state_dict()):
        raise UserError(f"--upcycle-from {run}: checkpoint {tag} does not hold the dense model its config.json "
                        f"describes; restore the run or upcycle another")
    with torch.no_grad():
        model.load_state_dict(rest, strict=False)
        experts = model.moe.experts
        w_in_FD, w_out_DF = ffn["hidden.0.weight"].float(), ffn["out.weight"].float()
        for local, (e_in, e_out) in enumerate(zip(experts.w_in, experts.w_out)):
            factor_in, factor_out = _noise(noise, seed, experts.first_global_expert + local, e_in.shape)
            e_in.copy_(w_in_FD * factor_in)
            e_out.copy_(w_out_DF.t() / experts.output_scale * factor_out)


def _noise(noise: float, seed: int, expert: int, shape: torch.Size) -> tuple[torch.Tensor | float, ...]:
    """Each expert's multiplicative noise 1 + noise·N(0, 1) per weight, drawn from (seed, global expert): the same on
    every layout, so expert parallelism changes nothing."""
    if not noise:
        return 1.0, 1.0
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * expert + 17)
    return tuple(1 + noise * torch.randn(shape, generator=generator) for _ in range(2))
