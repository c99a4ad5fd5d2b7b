"""Qwen3-30B-A3B (mixture of experts: 48 layers of 128 experts, 8 active per token; 30.5B parameters, 3.3B active),
random init or `model.init_from=DIR` of its weights and tokenizer.
`--config portable_fsdp/configs/qwen3_30b_a3b.py:VARIANT`:

  8xh100  one node of 8 H100 80 GB: fsdp 8 with the experts split over ep 8 (16 per rank), sequences of 4096
  8xh200  one node of 8 H200 141 GB: the same at sequences of 8192
  v5p-16  a TPU v5p-16 slice (8 chips, 95 GB each): SPMD FSDPv2 with the experts split over ep 8
  smoke   the same architecture at CPU size (4 experts, 2 active): trains in seconds on --backend cpu
"""
from portable_fsdp.configs.hardware import Variant, build

ARCHITECTURE = {"model.architecture": "qwen3_moe", "model.vocab_size": 151936, "model.hidden_size": 2048,
                "model.intermediate_size": 6144, "model.num_hidden_layers": 48, "model.num_attention_heads": 32,
                "model.num_key_value_heads": 4, "model.max_position_embeddings": 40960, "model.rope_theta": 1000000.0,
                "model.rms_norm_eps": 1e-6,
                "model.config_overrides": {"head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
                                           "num_experts_per_tok": 8, "norm_topk_prob": True,
                                           "output_router_logits": True, "router_aux_loss_coef": 0.001}}
VARIANTS = {
    "8xh100": Variant("cuda", 8, "h100", {"data.seq_len": 4096, "train.batch_size": 16, "plan.ep_size": 8}),
    "8xh200": Variant("cuda", 8, "h200", {"data.seq_len": 8192, "train.batch_size": 16, "plan.ep_size": 8}),
    "v5p-16": Variant("xla", 8, "v5p", {"data.seq_len": 4096, "train.batch_size": 16, "plan.ep_size": 8,
                                        "model.attn_implementation": "eager"}),
}
SMOKE = {"model.num_attention_heads": 4, "model.num_key_value_heads": 2,
         "model.config_overrides": {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
                                    "num_experts_per_tok": 2, "norm_topk_prob": True, "output_router_logits": True,
                                    "router_aux_loss_coef": 0.001}}


def get_config(variant: str = "smoke"):
    return build(ARCHITECTURE, VARIANTS, SMOKE, variant)
