"""`moe-scale eval --expert-stats / --top-tokens N`: which tokens each expert of each MoE layer takes.

Every expert layer records its routes (`RoutedLayer.record_routes`: the flat gates' pairs and the hierarchical
gate's, which are chosen beside the experts after the exchange), and a forward hook on the layer keeps, per batch,
each (token, expert, gate) pair of the real (non-padding) tokens. At the end, per layer: the load (tokens routed)
and importance (summed gates) per expert with CV and max/mean over the whole evaluation set, and per expert (like
Shazeer et al.'s Table 9, which sorts a batch's inputs by G(x)_i and shows the words around each position) the
N positions with the largest gate, shown as the input word with its two preceding words, plus the words routed
there most often.
The MoE input at position i has read words up to w_i, so the context shown ends at w_i.

Legend (docs/shapes.md): C (token, expert) pairs, E experts, B sequences, T positions.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from moe_scale.data.vocab import Vocab
from moe_scale.metrics.balance import balance_metrics

CONTEXT_WORDS = 3


class ExpertTokenStats:
    def __init__(self, layers, vocab: Vocab, tokens, top_n: int):
        self.layers, self.vocab, self.tokens, self.top_n = list(layers), vocab, tokens, top_n
        self.pairs: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        self._positions_N: torch.Tensor | None = None
        for layer in self.layers:
            layer.record_routes, layer.routes = True, None
        self._hooks = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]

    def begin_batch(self, positions_BT: torch.Tensor) -> None:
        self._positions_N = positions_BT.reshape(-1)

    def _hook(self, layer_index: int):
        def record(layer, inputs, output):
            token_C, expert_C, gate_C = (t.detach().cpu() for t in layer.routes)
            position_C = self._positions_N[token_C]
            real_C = position_C >= 0
            self.pairs[layer_index].append((position_C[real_C], expert_C[real_C], gate_C[real_C].float()))
        return record

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for layer in self.layers:
            layer.record_routes, layer.routes = False, None

    def report(self) -> dict:
        """Per layer `layer<i>`: balance over the whole set and per-expert loads / top tokens (all ranks)."""
        out = {}
        for index, layer in enumerate(self.layers):
            local = ([torch.cat(parts) for parts in zip(*self.pairs[index])] if self.pairs[index] else
                     [torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0)])
            position_C, expert_C, gate_C = _gather(local)
            E = layer.num_experts
            load_E = torch.bincount(expert_C, minlength=E).double()
            importance_E = torch.zeros(E, dtype=torch.float64).index_add_(0, expert_C, gate_C.double())
            experts = []
            for e in range(E):
                mine = expert_C == e
                entry = {"expert": e, "load": int(load_E[e]), "importance": float(importance_E[e])}
                if self.top_n:
                    pos, gate = position_C[mine], gate_C[mine]
                    order = torch.argsort(gate, descending=True, stable=True)[: self.top_n]
                    entry["top_by_gate"] = [{"gate": round(float(gate[j]), 4), "context": self._context(int(pos[j]))}
                                            for j in order]
                    words = Counter(self.vocab.words[int(self.tokens[p])] for p in pos.tolist())
                    entry["top_words"] = [[w, c] for w, c in words.most_common(self.top_n)]
                experts.append(entry)
            out[f"layer{index}"] = {**balance_metrics(importance_E, load_E, layer.expert_parallel_size),
                                    "tokens": int(load_E.sum()), "experts": experts}
        return out

    def _context(self, position: int) -> str:
        words = [self.vocab.words[int(t)] for t in self.tokens[max(0, position - CONTEXT_WORDS + 1): position + 1]]
        return " ".join(words[:-1] + [f"[{words[-1]}]"])


def _gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Concatenate each tensor over all ranks (rank order)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensors
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensors)
    return [torch.cat([g[i] for g in gathered]) for i in range(len(tensors))]


def format_expert_report(report: dict, top_n: int) -> str:
    lines = []
    for layer, stats in report.items():
        lines.append(f"{layer}: {stats['tokens']} routed token copies  cv(importance) {stats['cv_importance']:.3f}  "
                     f"cv(load) {stats['cv_load']:.3f}  max/mean load {stats['max_over_mean_load']:.2f}"
                     + (f" ({stats['max_over_mean_rank_load']:.2f} per rank)" if "max_over_mean_rank_load" in stats
                        else ""))
        lines.append("  expert      load  importance" + ("  top tokens by gate (context [word])" if top_n else ""))
        for e in stats["experts"]:
            tops = "  |  ".join(t["context"] for t in e.get("top_by_gate", []))
            lines.append(f"  {e['expert']:>6}  {e['load']:>8}  {e['importance']:>10.2f}  {tops}")
    return "\n".join(lines)
