"""Router replay: record each routed layer's chosen experts per token (`--record-routes DIR`), and route a later
forward by them (`--replay-routes DIR`) with the gate values computed from the live router's scores, so a replayed
expert the router would not pick still gets its gate and its gradient (reinforcement-learning fine-tuning, where the
inference engine and the trainer must agree on the experts; or reproducing a loss spike).

Legend (docs/shapes.md): N tokens, K experts per token.

A forward is recorded at a position (phase, step, micro-batch), set by whoever runs the forwards (the training loop,
eval, generate) with `at()`; each routed layer's experts_NK is kept on the device and written at `flush()` (once per
step: one copy to the host per step, none per layer). On disk, in DIR:

    routes.json           {"format": 1, "dtype": "int16" | "int32", "world_size": W, "model": {...}, "data": {...}}
    rank<r>.bin           the experts of every recorded forward of rank r, row-major [N, K], little-endian
    rank<r>.index         32 bytes per forward: phase, layer, step, micro-batch, N, K (INDEX_DTYPE)

`read_routes(DIR, rank)` (below) reads them back: numpy only, no moe_scale model needed. A replay looks each
forward up by its position and layer; a record made for another model, other data or another number of processes,
or one without the forward asked for, is refused in one line. The balance losses and statistics of the router stay
its own choice's; the experts the tokens go to, and their gates, are the record's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from moe_scale.errors import UserError
from moe_scale.files import write_json_atomic

FORMAT = 1
PHASES = ("train", "eval", "generate")
INDEX_DTYPE = np.dtype([("phase", "<i4"), ("layer", "<i4"), ("step", "<i8"), ("micro", "<i4"), ("n", "<i4"),
                        ("k", "<i4"), ("pad", "<i4")])
HEADER = "routes.json"


def read_routes(directory: str | Path, rank: int = 0) -> Iterator[dict]:
    """Every recorded forward of `rank`: {"phase", "layer", "step", "micro", "experts": int array [N, K]}."""
    directory = Path(directory)
    header = json.loads((directory / HEADER).read_text())
    index = np.fromfile(directory / f"rank{rank}.index", dtype=INDEX_DTYPE)
    data = np.memmap(directory / f"rank{rank}.bin", dtype=np.dtype(header["dtype"]).newbyteorder("<"), mode="r") \
        if index.size else np.zeros(0, dtype=header["dtype"])
    offset = 0
    for entry in index:
        size = int(entry["n"]) * int(entry["k"])
        yield {"phase": PHASES[entry["phase"]], "layer": int(entry["layer"]), "step": int(entry["step"]),
               "micro": int(entry["micro"]), "experts": np.asarray(data[offset:offset + size]).reshape(
                   int(entry["n"]), int(entry["k"]))}
        offset += size


class RouteTape:
    """Records or replays the routing of `layers` (the model's routed layers, in order). Attach it to the layers
    with `attach`; set the position of each forward with `at`; `flush` after each step (recording)."""

    def __init__(self, directory: Path, mode: str, rank: int, world_size: int, model_sig: dict, data_sig: dict,
                 flag: str):
        self.directory, self.mode, self.rank, self.flag = Path(directory), mode, rank, flag
        self.position: tuple[int, int, int] | None = None
        self.pending: list[tuple[tuple[int, int, int, int], torch.Tensor]] = []
        header = {"format": FORMAT, "world_size": world_size, "model": model_sig, "data": data_sig}
        if mode == "record":
            self._start_record(header)
        else:
            self._load_replay(header)

    # ---------------------------------------------------------------- the two modes' files

    def _start_record(self, header: dict) -> None:
        d = self.directory
        if self.rank == 0:   # (the others may see rank 0's header half-written)
            if d.exists() and any(d.iterdir()) and not (d / HEADER).is_file():
                raise UserError(f"{self.flag} {d}: the directory holds other files; give a new or empty directory")
            if (d / HEADER).is_file() and json.loads((d / HEADER).read_text()).get("model") != header["model"]:
                raise UserError(f"{self.flag} {d}: it holds routes of another model; give a new directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
            dtype = "int16" if max(header["model"]["experts"] or [0]) <= np.iinfo(np.int16).max else "int32"
            if self.rank == 0:
                write_json_atomic(d / HEADER, {**header, "dtype": dtype})
        except OSError as e:
            raise UserError(f"{self.flag} {d}: cannot write there ({e.strerror or e}); choose a writable "
                            f"directory") from None
        self.dtype = np.dtype(dtype)

    def _load_replay(self, header: dict) -> None:
        d = self.directory
        try:
            saved = json.loads((d / HEADER).read_text())
            index = np.fromfile(d / f"rank{self.rank}.index", dtype=INDEX_DTYPE)
        except (OSError, ValueError) as e:
            raise UserError(f"{self.flag} {d}: not a route record ({e}); record one with --record-routes") from None
        for what in ("world_size", "model", "data"):
            if saved.get(what) != header[what]:
                theirs, ours = saved.get(what), header[what]
                if isinstance(theirs, dict) and isinstance(ours, dict):
                    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
                    shown = f"its {', '.join(differ)} differ"
                else:
                    shown = f"{theirs} there, {ours} here"
                named = {"world_size": "another number of processes", "model": "another model",
                         "data": "other data"}[what]
                raise UserError(f"{self.flag} {d}: recorded for {named} ({shown}); replay "
                                f"a record made by this model on the same data, settings and number of processes")
        self.dtype = np.dtype(saved["dtype"])
        sizes = index["n"].astype(np.int64) * index["k"]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if index.size else sizes
        self.entries = {(int(e["phase"]), int(e["step"]), int(e["micro"]), int(e["layer"])): (int(s), int(e["n"]),
                                                                                             int(e["k"]))
                        for e, s in zip(index, starts)}
        self.data = np.memmap(d / f"rank{self.rank}.bin", dtype=self.dtype.newbyteorder("<"), mode="r") \
            if index.size else None

    # ---------------------------------------------------------------- the forwards

    def attach(self, layers) -> None:
        for number, layer in enumerate(layers):
            layer.route_tape, layer.tape_index = self, number
            layer.router.keep_scores = self.mode == "replay"

    def at(self, phase: str, step: int, micro: int = 0) -> None:
        """The position of the forwards that follow (None after `clear`: not recorded, not replayed)."""
        self.position = (PHASES.index(phase), step, micro)

    def clear(self) -> None:
        self.position = None

    def apply(self, layer, route):
        """The route the layer uses: the router's (recording it), or the record's experts with live gates."""
        if self.position is None:
            return route
        experts_NK = route.experts_NK
        if self.mode == "record":
            self.pending.append(((*self.position, layer.tape_index), experts_NK.detach()))
            return route
        key = (*self.position, layer.tape_index)
        if key not in self.entries:
            phase, step, micro, number = key
            raise UserError(f"{self.flag} {self.directory}: no recorded routes for {PHASES[phase]} step {step}, "
                            f"micro-batch {micro}, routed layer {number} on rank {self.rank}; record the run that far")
        start, n, k = self.entries[key]
        if (n, k) != tuple(experts_NK.shape):
            raise UserError(f"{self.flag} {self.directory}: {PHASES[key[0]]} step {key[1]} has {n} tokens x {k} "
                            f"experts recorded and {experts_NK.shape[0]} x {experts_NK.shape[1]} here; replay it "
                            f"with the batch settings it was recorded with")
        replayed_NK = torch.from_numpy(np.asarray(self.data[start:start + n * k]).astype(np.int64)).view(n, k)
        replayed_NK = replayed_NK.to(experts_NK.device)
        return route.with_experts(replayed_NK, layer.router.gates_for(replayed_NK))

    def flush(self) -> None:
        """Recording: the forwards since the last flush, to disk (data first, then their index entries)."""
        if self.mode != "record" or not self.pending:
            return
        experts = torch.cat([e.reshape(-1) for _, e in self.pending]).cpu().numpy()
        index = np.zeros(len(self.pending), dtype=INDEX_DTYPE)
        for row, ((phase, step, micro, number), e) in zip(index, self.pending):
            row["phase"], row["step"], row["micro"], row["layer"] = phase, step, micro, number
            row["n"], row["k"] = e.shape
        try:
            with open(self.directory / f"rank{self.rank}.bin", "ab") as f:
                f.write(experts.astype(self.dtype.newbyteorder("<")).tobytes())   # little-endian on any host
            with open(self.directory / f"rank{self.rank}.index", "ab") as f:
                f.write(index.tobytes())
        except OSError as e:
            raise UserError(f"{self.flag} {self.directory}: writing the routes failed ({e.strerror or e})") from None
        self.pending = []


def open_tape(layers, gate: str, record: str | None, replay: str | None, rank: int, world_size: int,
              data_sig: dict) -> RouteTape | None:
    """The tape --record-routes DIR or --replay-routes DIR asks for, attached to `layers` (None: neither)."""
    if record and replay:
        raise UserError("--record-routes and --replay-routes together: a replayed run's routes are its record's; "
                        "pass one of them")
    if not (record or replay):
        return None
    mode, flag, directory = ("replay", "--replay-routes", replay) if replay else ("record", "--record-routes", record)
    if not layers:
        raise UserError(f"{flag}: this model has no routed layers (no MoE layer, no MoA attention); drop the flag")
    for router in (layer.router for layer in layers):
        name = router.name or type(router).__name__
        if not router.k_per_token:
            raise UserError(f"{flag}: the {name} gate does not give every token k experts of one layer, so its "
                            f"routes are not recorded; use --gate softmax_topk, aux_free, node_limited or noisy_topk")
        if mode == "replay" and not router.replays:
            raise UserError(f"{flag}: the {name} gate cannot be replayed (its gate values are not a function of "
                            f"given experts); use --gate softmax_topk, aux_free or node_limited")
    tape = RouteTape(Path(directory), mode, rank, world_size, model_signature(layers, gate), data_sig, flag)
    tape.attach(layers)
    return tape


def model_signature(layers, gate: str) -> dict:
    return {"gate": gate, "layers": len(layers), "experts": [layer.num_experts for layer in layers],
            "top_k": [layer.router.k for layer in layers]}
