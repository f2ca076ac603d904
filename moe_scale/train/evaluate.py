"""Per-word perplexity of a model over a split (data/eval_windows.py says what is counted), summed over
all data-parallel ranks, with the MoE balance statistics of the pass (real tokens only: the padding rows of
the last windows are routed, but left out of the balance).

Legend (docs/shapes.md): B sequences (evaluation windows), T positions.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe_scale.data.eval_windows import EvalWindows
from moe_scale.distributed.comm import collective_device
from moe_scale.labels import IGNORE
from moe_scale.metrics.balance import MoEMetrics

COUNTED = ("every word (out-of-vocabulary ones as <UNK>) and each sentence's </S>; <S> is never predicted; "
           "perplexity per word: exp(total NLL / (words + sentences)), for subword tokenizers too")


def oov_rate(counts: dict) -> float:
    """The share of the text's words that became <UNK>: they cost the model little, so a word run's perplexity
    compares with another's only at about the same rate (docs/data.md#which-perplexities-compare)."""
    return counts["oov_words"] / counts["words"] if counts["words"] else 0.0


@torch.no_grad()
def evaluate(model, windows: EvalWindows, max_batches: int = 0, device=None, observer=None,
             describe: bool = False, tape=None) -> dict:
    """exp(total NLL / counted words) over the split (every rank runs the same number of batches, which
    expert-parallel all-to-alls need). `observer` (e.g. ExpertTokenStats) is told each batch's positions;
    `describe` adds what was counted (word, sentence and OOV counts and the OOV rate of a complete pass); `tape`
    (moe/route_tape.py) records or replays each batch's routing."""
    from moe_scale.moe.routed_layer import real_tokens   # here: it imports DeepSpeed, which `moe-scale` may not

    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=collective_device())   # [NLL sum, counted targets, words]
    balance = MoEMetrics(model.moe_layers())
    for index, (inputs, targets) in enumerate(windows.all_windows()):
        if max_batches and index >= max_batches:
            break
        if observer is not None:
            observer.begin_batch(windows.batch_positions(index))
        real_BT = windows.real_tokens(index)
        if tape is not None:   # --record-routes / --replay-routes (moe/route_tape.py)
            tape.at("eval", index)
        with real_tokens(balance.layers, None if real_BT is None else real_BT.reshape(-1).to(device)):
            out = model(inputs.to(device), targets.to(device))
        if tape is not None:
            tape.clear()
            tape.flush()
        counted = int((targets != IGNORE).sum())
        totals += torch.tensor([out.nll_sum.item(), counted, windows.counted_words(index)], dtype=torch.float64,
                               device=totals.device)
        balance.add()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    nll, tokens, words = totals.tolist()
    described = describe and (not max_batches or max_batches >= windows.num_batches)
    ppl = math.exp(min(nll / words, 709.0)) if math.isfinite(nll) else float("nan")   # exp(709): float's top
    return {"ppl": ppl, "nll_per_token": nll / tokens, "tokens": int(tokens), "words_predicted": int(words),
            **({"words": windows.counts["words"], "sentences": windows.counts["sentences"],
                "oov_words": windows.counts["oov_words"], "oov_rate": oov_rate(windows.counts),
                "counted": COUNTED} if described else {}),
            **balance.values()}
