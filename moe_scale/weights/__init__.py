"""Weight formats of other libraries, below `train` (which imports them with --init-from-hf) and `inference`
(which exports them): hf_native.py maps a --block llama model to and from transformers' Mixtral, Qwen2-MoE and
Llama classes."""
