"""What a model costs, without training it: analytic parameter and FLOP counts (flops.py, attention_flops.py),
the papers' models as presets (presets.py), and per-GPU memory on a cluster (plan.py)."""
