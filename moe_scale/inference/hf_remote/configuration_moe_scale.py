"""transformers configuration of a model exported by `moe-scale export --format hf`: the moe_scale run
configuration it was trained with, and its vocabulary size."""

from transformers import PretrainedConfig


class MoEScaleConfig(PretrainedConfig):
    model_type = "moe_scale"

    def __init__(self, run_config: dict | None = None, vocab_size: int = 0, context: int = 0, **kwargs):
        self.run_config = run_config or {}
        self.vocab_size = vocab_size
        self.context = context          # a transformer's trained positions (0: an LSTM, unbounded)
        kwargs.setdefault("bos_token_id", 1)
        kwargs.setdefault("eos_token_id", 2)
        kwargs.setdefault("pad_token_id", 2)
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)
