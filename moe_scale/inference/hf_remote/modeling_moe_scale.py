"""transformers model of a run exported by `moe-scale export --format hf`: moe_scale's own model (LSTM-MoE or
transformer with MHA, MoA or MAE and a dense or MoE FFN), all experts in one process, for inference.

logits are log-probabilities of the next word (a softmax over them is the model's distribution, whatever
softmax it was trained with). Each call runs the whole sequence given (no cache is handed to transformers:
`generate` re-reads the prefix every step; `moe-scale generate` keeps the LSTM state / KV cache instead)."""

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moe_scale import MoEScaleConfig


class MoEScaleForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MoEScaleConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"

    def __init__(self, config: MoEScaleConfig):
        super().__init__(config)
        from moe_scale.config import RunConfig
        from moe_scale.models.build import build_model

        run_config = RunConfig.from_dict(config.run_config, "the exported config.json's run_config")
        if run_config.softmax.kind == "sampled":   # the full one at eval (its sampler's training counts stay behind)
            run_config.softmax.kind = "full"
        self.lm = build_model(run_config, config.vocab_size)
        for layer in self.lm.moe_layers():   # weights stored by module path, as transformers loads them
            layer.use_module_path_keys()
        self.post_init()

    def _init_weights(self, module):
        """Every weight comes from model.safetensors. transformers 5 builds the model empty and leaves the buffers
        that are not saved (an attention layer's head mask) uninitialised, so they get their built values here."""
        reset = getattr(module, "reset_unsaved_buffers", None)
        if reset is not None:
            reset()

    def forward(self, input_ids: torch.Tensor, attention_mask=None, labels: torch.Tensor | None = None, **kwargs):
        if self.config.context and input_ids.shape[1] > self.config.context:
            raise ValueError(f"{input_ids.shape[1]} positions: the model was trained on {self.config.context}")
        log_probs, _ = self.lm.eval().decode(input_ids)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.nll_loss(log_probs[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=log_probs)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False   # no transformers cache: each call reads the whole sequence
