"""The files `moe-scale export --format hf` copies beside the weights, loaded by transformers with
trust_remote_code=True (they import moe_scale, which must be installed where the model is loaded)."""
