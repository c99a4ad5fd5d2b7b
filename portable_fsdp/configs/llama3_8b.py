"""Llama-3-8B (dense, GQA 32/8 heads, vocabulary 128,256), random init or `model.init_from=DIR` (or a hub
id) of its weights and tokenizer. `--config portable_fsdp/configs/llama3_8b.py:VARIANT`:

  8xh100  one node of 8 H100 80 GB: fsdp 8, sequences of 8192, 4 per rank per step
  1xh200  one H200 141 GB: fp32 master weights, gradients and AdamW live on the host (cpu_offload), 4096 tokens
  v5p-8   a TPU v5p-8 slice (4 chips, 95 GB each): SPMD FSDPv2 over the 4 chips, sequences of 4096 (eager
          attention, which bf16 needs under SPMD, holds each head's scores: one sequence per chip per micro-batch)
  smoke   the same architecture at CPU size: trains in seconds on --backend cpu
"""
from portable_fsdp.configs.hardware import Variant, build

ARCHITECTURE = {"model.architecture": "llama", "model.vocab_size": 128256, "model.hidden_size": 4096,
                "model.intermediate_size": 14336, "model.num_hidden_layers": 32, "model.num_attention_heads": 32,
                "model.num_key_value_heads": 8, "model.max_position_embeddings": 8192, "model.rope_theta": 500000.0,
                "model.rms_norm_eps": 1e-5}
VARIANTS = {
    "8xh100": Variant("cuda", 8, "h100", {"data.seq_len": 8192, "train.batch_size": 32}),
    "1xh200": Variant("cuda", 1, "h200", {"data.seq_len": 4096, "train.batch_size": 16, "train.grad_accum_steps": 16,
                                          "plan.cpu_offload": True}),
    "v5p-8": Variant("xla", 4, "v5p", {"data.seq_len": 4096, "train.batch_size": 8, "train.grad_accum_steps": 2,
                                       "model.attn_implementation": "eager"}),
}
SMOKE = {"model.num_attention_heads": 8, "model.num_key_value_heads": 2}


def get_config(variant: str = "smoke"):
    return build(ARCHITECTURE, VARIANTS, SMOKE, variant)
