"""moe_scale: sparsely-gated mixture-of-experts language models on DeepSpeed.

Importing the package changes nothing in the process: the host-memory settings a training run wants
(`moe_scale.host_memory.apply_process_settings`) are applied by the `moe-scale` command and the benchmarks.
"""

__version__ = "0.1.0"
