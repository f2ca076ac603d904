"""Text from a trained model: a prompt (after <S>) continued token by token (a word, or a subword piece for a
BPE run) until </S> or a token limit, each new token one decode step (the LSTMs' states, the transformer's KV
cache), and on request the experts each word was routed to in every expert layer (Shazeer et al.'s Table 9
view).

Legend (docs/shapes.md): B sequences, T positions, V vocabulary size, C (token, expert) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moe_scale.data import Vocab
from moe_scale.data.subwords import SubwordTokenizer
from moe_scale.inference.sampling import SamplingConfig, next_words
from moe_scale.moe.deepspeed_adapter import ExpertParallelModule

UNK_SHOWN = "<unk>"


@dataclass
class Sample:
    words: list[str]                                   # generated tokens as shown, without the closing </S>
    ids: list[int] = field(default_factory=list)       # the same, as ids
    finished: bool = False                             # ended with </S> (else at the word limit)
    routes: list[dict[str, list[tuple[int, float]]]] = field(default_factory=list)   # per word: layer -> (expert, gate)


def shown(vocab: Vocab | SubwordTokenizer, word_id: int) -> str:
    """One token as printed: <unk> for an unknown word, a subword piece as it reads."""
    if isinstance(vocab, SubwordTokenizer):
        return vocab.token_text(word_id)
    return UNK_SHOWN if word_id == Vocab.UNK_ID else vocab.words[word_id]


def render(vocab: Vocab | SubwordTokenizer, ids: list[int]) -> str:
    """Token ids as text: words joined by spaces, subword pieces decoded."""
    if isinstance(vocab, SubwordTokenizer):
        return vocab.decode(ids)
    return " ".join(shown(vocab, i) for i in ids)


class RouteRecorder:
    """The (token, expert, gate) pairs of every expert layer's last forward (the layers keep them while recorded)."""

    def __init__(self, model: nn.Module):
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelModule)]
        self._on_host: dict[str, tuple] = {}   # layer -> (its routes object, those tensors on the host)
        for _, layer in self.layers:
            layer.record_routes, layer.routes = True, None

    def of_token(self, token: int) -> dict[str, list[tuple[int, float]]]:
        """Layer -> [(expert, gate)] of token `token` of the last forward, largest gate first."""
        out = {}
        for name, layer in self.layers:
            if layer.routes is None:
                continue
            if name not in self._on_host or self._on_host[name][0] is not layer.routes:   # once per forward
                self._on_host[name] = (layer.routes, tuple(t.detach().cpu() for t in layer.routes))
            token_C, expert_C, gate_C = self._on_host[name][1]
            mine = (token_C == token).nonzero()[:, 0]
            pairs = sorted(zip(expert_C[mine].tolist(), gate_C[mine].float().tolist()), key=lambda p: -p[1])
            out[name] = pairs
        return out

    def close(self) -> None:
        for _, layer in self.layers:
            layer.record_routes, layer.routes = False, None


@torch.no_grad()
def generate(model: nn.Module, vocab: Vocab, prompt_ids: list[int], num_samples: int, max_new_words: int,
             sampling: SamplingConfig, generator: torch.Generator, device: torch.device,
             show_experts: bool = False, tape=None) -> list[Sample]:
    """`num_samples` continuations of <S> + prompt, sampled together as one batch; `tape` (moe/route_tape.py)
    records each decoding step's routing (step 0: <S> and the prompt)."""
    model.eval()
    recorder = RouteRecorder(model) if show_experts else None
    try:
        inputs_BT = torch.tensor([[Vocab.BOS_ID, *prompt_ids]] * num_samples, device=device)
        if tape is not None:
            tape.at("generate", 0)
        log_probs_BTV, state = model.decode(inputs_BT)
        samples = [Sample([]) for _ in range(num_samples)]
        for step in range(max_new_words):
            word_B = next_words(log_probs_BTV[:, -1], sampling, generator)
            if show_experts or step + 1 < max_new_words:   # the word's own routing needs it as an input
                if tape is not None:
                    tape.at("generate", step + 1)
                log_probs_BTV, state = model.decode(word_B[:, None], state)
            for b, (sample, word) in enumerate(zip(samples, word_B.tolist())):
                if sample.finished:
                    continue
                if word == Vocab.EOS_ID:
                    sample.finished = True
                    continue
                sample.words.append(shown(vocab, word))
                sample.ids.append(word)
                if recorder is not None:
                    sample.routes.append(recorder.of_token(b))
            if all(s.finished for s in samples):
                break
        return samples
    finally:
        if recorder is not None:
            recorder.close()
        if tape is not None:
            tape.flush()


def format_samples(vocab: Vocab | SubwordTokenizer, prompt_ids: list[int], samples: list[Sample],
                   show_experts: bool) -> str:
    lines = []
    for i, sample in enumerate(samples):
        text = render(vocab, [*prompt_ids, *sample.ids]) + ("" if sample.finished else " ...")
        lines.append(text if len(samples) == 1 and not show_experts else f"[{i + 1}] {text}")
        if show_experts and sample.routes:
            width = max(len(w) for w in sample.words)
            unit = "token" if isinstance(vocab, SubwordTokenizer) else "word"
            lines.append(f"    {unit:<{width}}  " + "  |  ".join(sample.routes[0]))
            for word, routes in zip(sample.words, sample.routes):
                cells = ["  ".join(f"e{e} {g:.2f}" for e, g in pairs) for pairs in routes.values()]
                lines.append(f"    {word:<{width}}  " + "  |  ".join(cells))
    return "\n".join(lines)


def ended_at_once(samples: list[Sample], greedy: bool) -> str | None:
    """What to tell the user when samples end their sentence (</S>) before any new token: otherwise the output is
    the prompt alone, as if nothing had run. None when every sample has new tokens."""
    empty = [i + 1 for i, sample in enumerate(samples) if sample.finished and not sample.ids]
    if not empty:
        return None
    if len(samples) == 1:
        who = "the model ended the sentence at once"
    else:
        numbers = ", ".join(map(str, empty[:-1])) + (" and " if len(empty) > 1 else "") + str(empty[-1])
        who = f"sample{'s' if len(empty) > 1 else ''} {numbers} of {len(samples)} ended the sentence at once"
    if greedy:
        return (f"{who}: the most likely token after the prompt is </S>, the end of a sentence, so nothing new "
                f"was generated; drop --greedy to sample, or give a longer prompt")
    return (f"{who}: </S>, the end of a sentence, was drawn right after the prompt, so nothing new was "
            f"generated; try another --seed or a longer prompt")
