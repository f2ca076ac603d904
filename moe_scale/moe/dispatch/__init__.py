"""Token dispatch: send each (token, expert) pair's row to the rank that owns the expert, and bring results back.

    dispatcher.py   sort by expert, drop over capacity, one row per (token, rank), combine (AllToAllDispatcher)
    exchange.py     how rows move: locally, one flat all-to-all, or within nodes then across them
"""

from moe_scale.moe.dispatch.dispatcher import MODES, AllToAllDispatcher, DispatchState

__all__ = ["MODES", "AllToAllDispatcher", "DispatchState"]
