"""Sparse upcycling (Komatsuzaki et al. 2022): an MoE run that starts from a trained dense run.

Legend (docs/shapes.md): D model width, F expert hidden width.

Every expert starts as a copy of the dense run's feed-forward network (optionally each with its own small
multiplicative noise, `--upcycle-noise`), the router is new, and every other weight (embedding, LSTMs or attention,
norms, softmax) is the dense run's; the run reuses the dense run's tokenizer, so the ids mean the same words. An
expert then computes what the dense FFN did, so with gates that sum to 1 the upcycled model's output equals the
dense model's at step 0. The pairs, each an FFN and an expert of the same function:

- the LSTM LM's `lstm-ffn-lstm` with one hidden layer (MoE-1-Deep's dense "expert", `W_out relu(W_in x)`) ->
  `lstm-moe-lstm` with any gate (ReLU experts `scale · W_out relu(W_in x)`: W_out is copied divided by the scale);
- the llama block's dense SwiGLU FFN -> its SwiGLU experts (Mixtral's: the gate and up rows stacked in w_in).

The default transformer block's dense FFN (GELU, with biases) has no expert of its function: refused, as is any
pair whose shared weights differ in shape.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_scale.config import RunConfig
from moe_scale.deepspeed_internals import MODEL_STATES_FILE
from moe_scale.errors import UserError
from moe_scale.models.blocks import block_kind
from moe_scale.run_files import RunFiles

# Settings the copied weights' shapes (and meaning) depend on: they must be the dense run's.
_SHARED = ("model", "d_model", "lstm_hidden", "block", "num_layers", "tie_embeddings", "rope_theta", "attention",
           "num_heads", "head_dim", "vocab_size", "tokenizer", "min_count", "softmax", "adaptive_cutoffs")


def dense_run_to_upcycle(config: RunConfig) -> tuple[Path, str]:
    """(run, checkpoint tag) of --upcycle-from, checked: a finished dense run whose shapes fit this MoE model."""
    from moe_scale.train.checkpoint import choose_checkpoint

    from moe_scale.train.run_lock import live_owner

    run = Path(config.train.upcycle_from)
    flag = f"--upcycle-from {run}"
    if run.resolve() == Path(config.run.out).resolve():
        raise UserError(f"{flag}: it is this run's --out too, so writing the new run would replace the run it "
                        f"starts from; pass another --out")
    owner = live_owner(run)
    if owner is not None:   # its checkpoints rotate while it trains: the chosen one could vanish as it is read
        raise UserError(f"{flag}: the run is still training ({owner}); upcycle it when it has ended, or from a copy "
                        f"of one of its checkpoints")
    if not RunFiles(run).config.is_file() or not RunFiles(run).checkpoints.is_dir():
        raise UserError(f"{flag}: no trained run there (config.json and a complete checkpoint are needed); pass the "
                        f"--out directory of a finished dense `moe-scale train`")
    dense = RunConfig.load(RunFiles(run).config)
    _check_pair(config, dense, flag)
    tag, _ = choose_checkpoint(run, None, "--upcycle-from", dense)
    return run, tag


def _check_pair(config: RunConfig, dense: RunConfig, flag: str) -> None:
    if config.model.kind != dense.model.kind:
        raise UserError(f"{flag}: it is a --model {dense.model.kind} run, this one --model {config.model.kind}; "
                        f"upcycle a run of the same model")
    if config.model.kind == "transformer":
        blocks, dense_blocks = config.model.transformer, dense.model.transformer
        if not block_kind(config).upcycles or not block_kind(dense).upcycles:
            raise UserError(f"{flag}: the default transformer block's dense FFN (GELU, with biases) has no expert of "
                            f"its function (ReLU, no biases); upcycle a --block llama run (SwiGLU FFN and experts)")
        if dense_blocks.ffn != "dense" or blocks.ffn != "moe":
            raise UserError(f"{flag}: upcycling starts an --ffn moe run from an --ffn dense one; this pair is --ffn "
                            f"{dense_blocks.ffn} -> --ffn {blocks.ffn}")
        if config.moe.experts.hidden != dense_blocks.ffn_hidden:
            raise UserError(f"{flag}: its FFN is --ffn-hidden {dense_blocks.ffn_hidden} wide, this run's experts "
                            f"--expert-hidden {config.moe.experts.hidden}; pass --expert-hidden "
                            f"{dense_blocks.ffn_hidden}")
    else:
        lstm = dense.model.lstm
        if lstm.layout != "lstm-ffn-lstm" or lstm.ffn_layers != 1:
            raise UserError(f"{flag}: it is a --layout {lstm.layout} run"
                            + (f" with --ffn-layers {lstm.ffn_layers}" if lstm.layout == "lstm-ffn-lstm" else "")
                            + "; upcycling needs a dense FFN of one hidden layer, as each expert has: a --layout "
                              "lstm-ffn-lstm --ffn-layers 1 run")
        if config.model.lstm.layout != "lstm-moe-lstm":
            raise UserError(f"{flag}: this run is --layout {config.model.lstm.layout}, which has no experts to start "
                            f"from the dense FFN; pass --layout lstm-moe-lstm")
        if config.moe.experts.hidden != dense.moe.experts.hidden:
            raise UserError(f"{flag}: its FFN is --expert-hidden {dense.moe.experts.hidden} wide, this run asks for "
                            f"{config.moe.experts.hidden}; pass --expert-hidden {dense.moe.experts.hidden}")
    dense_kind = dense.block_expert_kind
    if config.expert_kind != dense_kind:   # the dense FFN is of the block's kind: each expert must compute it
        raise UserError(f"{flag}: its dense FFN is {dense_kind}, so experts starting from it are too; this run asks "
                        f"for --expert-kind {config.expert_kind}: pass --expert-kind {dense_kind}")
    leaves = RunConfig.leaves()
    for key in _SHARED:
        if config.get(key) != dense.get(key):
            raise UserError(f"{flag}: it was trained with {leaves[key].flag} {dense.get(key)}, this run asks for "
                            f"{config.get(key)}; the copied weights need the dense run's: pass "
                            f"{leaves[key].flag} {dense.get(key)}")


def upcycle(model: torch.nn.Module, run: Path, tag: str, noise: float, seed: int) -> None:
    """Loads the dense run's weights into `model` (built from the paired config): each MoE layer's experts that
    this process holds from the dense FFN in its place, the rest by name; the routers keep their fresh
    initialisation."""
    from moe_scale.models.vocab_parallel import names_of, row_split_keys
    from moe_scale.train.checkpoint import saved_layout
    from moe_scale.train.reshard import load_vocabulary_rows

    checkpoint = RunFiles(run).checkpoint(tag)
    state = torch.load(checkpoint / MODEL_STATES_FILE, map_location="cpu", weights_only=False)["module"]
    layers = _moe_layers_and_their_ffns(model)
    ffn_keys = {name for name in state if any(name.startswith(ffn) for ffn in layers.values())}
    rest = {name: value for name, value in state.items() if name not in ffn_keys}
    ours = set(model.state_dict()) | row_split_keys(model)   # (this rank's rows are taken from whole tables)
    saved = saved_layout(checkpoint)
    split_there = set(saved["vocab_rows"]) if saved else set()   # tables the dense run kept split, by rows
    if any(not any(name.startswith(moe) for moe in layers) for name in ours - set(rest) - split_there
           - names_of(model, split_there)) or set(rest) - ours:
        raise UserError(f"--upcycle-from {run}: checkpoint {tag} does not hold the dense model its config.json "
                        f"describes; restore the run or upcycle another")
    with torch.no_grad():
        model.load_state_dict(rest, strict=False)
        if split_there:
            load_vocabulary_rows(model, checkpoint, split_there)
        for prefix, ffn in layers.items():
            experts = model.get_submodule(prefix.rstrip(".")).experts
            w_in_FD, w_out_FD = _expert_weights({name[len(ffn):]: value for name, value in state.items()
                                                 if name.startswith(ffn)}, experts)
            for local in range(experts.num_local_experts):   # (with --etp-size: this rank's shard of each copy)
                factor_in, factor_out = _noise(noise, seed, experts.first_global_expert + local,
                                               w_in_FD.shape, w_out_FD.shape)
                experts.set_expert(local, w_in_FD * factor_in, w_out_FD * factor_out)


def _moe_layers_and_their_ffns(model: torch.nn.Module) -> dict[str, str]:
    """{prefix of each MoE layer's state: prefix of the dense FFN in its place}: the LSTM LM's `moe.` <- `ffn.`;
    a transformer block's `blocks.i.ffn.` <- the same."""
    from moe_scale.moe.layer import MoELayer

    return {name + ".": "ffn." if name == "moe" else name + "."
            for name, module in model.named_modules() if isinstance(module, MoELayer)}


def _expert_weights(ffn: dict[str, torch.Tensor], experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_in, w_out) of one expert computing the dense FFN `ffn` (its state by name)."""
    if experts.kind.gated:
        return torch.cat([ffn["gate_proj.weight"], ffn["up_proj.weight"]]).float(), ffn["down_proj.weight"].float().t()
    return ffn["hidden.0.weight"].float(), ffn["out.weight"].float().t() / experts.output_scale


def _noise(noise: float, seed: int, expert: int, *shapes: torch.Size) -> tuple[torch.Tensor | float, ...]:
    """Each expert's multiplicative noise 1 + noise·N(0, 1) per weight, drawn from (seed, global expert): the same on
    every layout, so expert parallelism changes nothing."""
    if not noise:
        return tuple(1.0 for _ in shapes)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * expert + 17)
    return tuple(1 + noise * torch.randn(shape, generator=generator) for shape in shapes)
