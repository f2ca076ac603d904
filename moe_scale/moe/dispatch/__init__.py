"""Token dispatch: send each (token, expert) pair's row to the rank that owns the expert, and bring results back.

    dispatcher.py        sort by expert, drop over capacity, one row per (token, rank), combine (AllToAllDispatcher)
    static_capacity.py   capacity mode in slots of a size the host knows: no read (StaticCapacityDispatcher)
    exchange.py          how rows move: locally, one flat all-to-all, or within nodes then across them
"""

from moe_scale.config import DispatchConfig
from moe_scale.moe.dispatch.dispatcher import MODES, AllToAllDispatcher, DispatchState
from moe_scale.moe.dispatch.static_capacity import StaticCapacityDispatcher


def build_dispatcher(num_units: int, num_local_units: int, config: DispatchConfig,
                     slots: bool = True) -> AllToAllDispatcher:
    """The dispatcher `config` asks for, over `num_units` destinations (experts, or the hierarchical gate's
    groups), `num_local_units` of them here. Capacity mode sends fixed-size slots where the caller takes them
    (`slots`: its experts read one row per pair), else counts its messages."""
    if config.mode == "capacity" and slots:
        return StaticCapacityDispatcher(num_units, num_local_units, config.capacity_factor)
    return AllToAllDispatcher(num_units, num_local_units, config.mode, config.capacity_factor,
                              config.rank_capacity_factor)


__all__ = ["MODES", "AllToAllDispatcher", "DispatchState", "StaticCapacityDispatcher", "build_dispatcher"]
