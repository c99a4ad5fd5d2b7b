"""A tiny Llama on the bundled corpus: the default run.

Variants (`--config portable_fsdp/configs/llama_tiny.py:VARIANT`):
  ""      a few hundred steps, ~2 minutes on 2 CPU cores with 2 processes
  "test"  a few-second run for tests and smoke checks
"""
from portable_fsdp.config.schema import base_config


def get_config(variant: str = ""):
    config = base_config()
    if variant == "test":
        config.model.hidden_size = 64
        config.model.intermediate_size = 160
        config.model.num_hidden_layers = 2
        config.model.num_attention_heads = 4
        config.model.num_key_value_heads = 2
        config.data.seq_len = 64
        config.train.steps = 20
        config.train.batch_size = 4
        config.train.eval_batch_size = 8
        config.train.eval_every = 0
        config.train.eval_max_batches = 4
        config.train.log_every = 5
        config.train.warmup_steps = 5
        config.train.progress_bar = False
    elif variant:
        raise ValueError(f"unknown variant {variant!r} of llama_tiny; use '' or 'test'")
    return config
