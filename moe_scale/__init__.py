"""moe_scale: sparsely-gated mixture-of-experts language models on DeepSpeed."""

__version__ = "0.1.0"
