"""Qwen2.5-7B (dense, GQA 28/4 heads, q/k/v biases, vocabulary 152,064), random init or `model.init_from=DIR` of
its weights (its tokenizer too). `--config portable_fsdp/configs/qwen2_5_7b.py:VARIANT`:

  8xh100  one node of 8 H100 80 GB: fsdp 4 x tp 2 (28 heads and 4 kv heads split in two), sequences of 8192
  1xh200  one H200 141 GB: fp32 master weights, gradients and AdamW live on the host (cpu_offload), 4096 tokens
  v5p-8   a TPU v5p-8 slice (4 chips, 95 GB each): SPMD FSDPv2 over the 4 chips, sequences of 4096 (eager
          attention, which bf16 needs under SPMD, holds each head's scores: one sequence per chip per micro-batch)
  smoke   the same architecture at CPU size: trains in seconds on --backend cpu
"""
from portable_fsdp.configs.hardware import Variant, build

ARCHITECTURE = {"model.architecture": "qwen2", "model.vocab_size": 152064, "model.hidden_size": 3584,
                "model.intermediate_size": 18944, "model.num_hidden_layers": 28, "model.num_attention_heads": 28,
                "model.num_key_value_heads": 4, "model.max_position_embeddings": 32768, "model.rope_theta": 1000000.0,
                "model.rms_norm_eps": 1e-6}
VARIANTS = {
    "8xh100": Variant("cuda", 8, "h100", {"data.seq_len": 8192, "train.batch_size": 16, "plan.tp_size": 2}),
    "1xh200": Variant("cuda", 1, "h200", {"data.seq_len": 4096, "train.batch_size": 16, "train.grad_accum_steps": 16,
                                          "plan.cpu_offload": True}),
    "v5p-8": Variant("xla", 4, "v5p", {"data.seq_len": 4096, "train.batch_size": 8, "train.grad_accum_steps": 2,
                                       "model.attn_implementation": "eager"}),
}
SMOKE = {"model.num_attention_heads": 4, "model.num_key_value_heads": 2}


def get_config(variant: str = "smoke"):
    return build(ARCHITECTURE, VARIANTS, SMOKE, variant)
