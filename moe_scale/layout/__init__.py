"""A run's layout over processes, below both `train` and the planner: the DeepSpeed JSON (ds_config.py) and the
checks a layout must pass (checks.py), so a layout `train` refuses is never planned."""
