"""One matrix of plan variants for every backend's parity tests.

Each variant is a set of `--config` overrides and a world size (ranks or devices). Which backends run it
is not written here: a backend runs every variant the capability table (portable_fsdp/capabilities.py)
says it honours — no setting refused there, none without effect (which would only repeat `base`); one
honoured with a warning runs. The
default suite runs `DEFAULT[backend]` (each axis and each backend at least once); the `slow` marker runs
the rest of what each backend honours. The per-backend runners (tests/dist/fsdp_variants.py under
torchrun, tests/xla/xla_variants.py in a torch_xla process, tests/flax in-process) take their variants
from here and compare each with the single-process reference (tests/parity/reference.py).
"""
from __future__ import annotations

import dataclasses
import os

from portable_fsdp import capabilities
from portable_fsdp.config.schema import apply_override, command_line_text, load_recipe
from portable_fsdp.config.validate import capability_context, plan_from_config

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "portable_fsdp", "configs", "llama_tiny.py") + ":test"
BACKENDS = ("cpu", "xla", "flax")  # cuda runs the cpu lowering on NCCL (tests/e2e/test_gpu.py)


@dataclasses.dataclass(frozen=True)
class Variant:
    overrides: dict
    world: int = 2

    @property
    def reference_overrides(self) -> dict:
        """The single-process reference depends on the model, data and train fields only, never on the plan."""
        return {k: v for k, v in self.overrides.items() if not k.startswith("plan.")}

    @property
    def bf16(self) -> bool:
        return self.overrides.get("plan.param_dtype") == "bfloat16"


CP2 = {"plan.cp_size": "2"}
ALLTOALL = {"plan.cp_rotate_method": "alltoall"}
DOCUMENTS = {"data.document_masking": "true"}
CHECKPOINTING = {"plan.activation_checkpointing": "true"}
V1 = {"plan.xla_fsdp_v2": "false"}

VARIANTS = {
    "base": Variant({}),
    "reshard_off": Variant({"plan.reshard_after_forward": "false"}),
    "cpu_offload": Variant({"plan.cpu_offload": "true"}),
    "activation_checkpointing": Variant(CHECKPOINTING),
    "hf_grad_ckpt": Variant({"plan.xla": "true", "plan.xla_fsdp_grad_ckpt": "true"}),  # read with xla: true only
    "model_grad_ckpt": Variant({"train.gradient_checkpointing": "true"}),  # transformers' own, not the plan's
    "bf16": Variant({"plan.param_dtype": "bfloat16"}),
    "bf16_eager": Variant({"plan.param_dtype": "bfloat16", "model.attn_implementation": "eager"}),
    "size_based_wrap": Variant({"plan.auto_wrap_policy": "SIZE_BASED_WRAP", "plan.min_num_params": "20000"}),
    "no_wrap": Variant({"plan.auto_wrap_policy": "NO_WRAP"}),
    "batch8": Variant({"train.batch_size": "8"}),
    "batch8_accum4": Variant({"train.batch_size": "8", "train.grad_accum_steps": "4"}),
    "rank0_loading": Variant({"plan.cpu_ram_efficient_loading": "true"}),
    "tied": Variant({"model.tie_word_embeddings": "true"}),
    "tied_rank0_loading": Variant({"model.tie_word_embeddings": "true", "plan.cpu_ram_efficient_loading": "true"}),
    "documents": Variant(DOCUMENTS),
    # Context parallelism: a sequence split over 2 or 4 ranks, alone or with fsdp.
    "cp2_allgather": Variant(CP2),
    "cp2_alltoall": Variant({**CP2, **ALLTOALL}),
    "documents_cp2_allgather": Variant({**DOCUMENTS, **CP2}),
    "documents_cp2_alltoall": Variant({**DOCUMENTS, **CP2, **ALLTOALL}),
    "fsdp4": Variant({}, world=4),
    "fsdp4_checkpointing": Variant(CHECKPOINTING, world=4),
    "fsdp2_cp2_allgather": Variant(CP2, world=4),
    "fsdp2_cp2_alltoall": Variant({**CP2, **ALLTOALL}, world=4),
    "fsdp2_cp2_alltoall_checkpointing": Variant({**CP2, **ALLTOALL, **CHECKPOINTING}, world=4),
    "cp4_allgather": Variant({"plan.cp_size": "4"}, world=4),
    "cp4_alltoall_contiguous": Variant({"plan.cp_size": "4", **ALLTOALL, "plan.cp_load_balance": "false"}, world=4),
    # Tensor and Ulysses sequence parallelism, HSDP: alone and with fsdp (the tiny Llama: 4 heads, 2 kv heads).
    "tp2": Variant({"plan.tp_size": "2"}),
    "fsdp2_tp2": Variant({"plan.tp_size": "2"}, world=4),
    "sp2": Variant({"plan.sp_size": "2"}),
    "fsdp2_sp2": Variant({"plan.sp_size": "2"}, world=4),
    "documents_sp2": Variant({**DOCUMENTS, "plan.sp_size": "2"}),
    "hsdp2x2": Variant({"plan.dp_replicate_size": "2"}, world=4),
    # NO_SHARD (DDP): every rank a whole replica, the replicas inferred from the world.
    "ddp2": Variant({"plan.dp_replicate_size": "-1", "plan.fsdp_size": "1"}),
    # ... and with what else changes the model or where its weights come from.
    "tied_tp2": Variant({"model.tie_word_embeddings": "true", "plan.tp_size": "2"}),
    "tp2_rank0_loading": Variant({"plan.cpu_ram_efficient_loading": "true", "plan.tp_size": "2"}),
    "tp2_cpu_offload": Variant({"plan.cpu_offload": "true", "plan.tp_size": "2"}),
    "sp2_checkpointing": Variant({**CHECKPOINTING, "plan.sp_size": "2"}),
    "tp2_checkpointing": Variant({**CHECKPOINTING, "plan.tp_size": "2"}),  # recomputation re-runs the tp input hooks
    "tp2_cp2": Variant({**CP2, "plan.tp_size": "2"}, world=4),
    "sp2_tp2": Variant({"plan.sp_size": "2", "plan.tp_size": "2"}, world=4),  # 1 kv head per tp rank, 2 sp ranks
    "hsdp2_tp2": Variant({"plan.dp_replicate_size": "2", "plan.tp_size": "2"}, world=4),
    # The loss a few tokens at a time (train.loss_chunk_tokens; 128 tokens per rank: 6 chunks, the last shorter),
    # and on the whole micro-batch's logits.
    "loss_chunks": Variant({"train.loss_chunk_tokens": "24"}),
    "loss_chunks_cp2": Variant({**CP2, "train.loss_chunk_tokens": "24"}),
    "loss_chunks_accum4": Variant({"train.batch_size": "8", "train.grad_accum_steps": "4",
                                   "train.loss_chunk_tokens": "8"}),
    "tied_tp2_loss_chunks": Variant({"model.tie_word_embeddings": "true", "plan.tp_size": "2",
                                     "train.loss_chunk_tokens": "24"}),
    "unchunked_loss": Variant({"train.loss_chunk_tokens": "0"}),
    # torch_xla's FSDP v1: one process per device, one PJRT CPU device here.
    "v1": Variant(V1, world=1),
    "v1_checkpointing": Variant({**V1, **CHECKPOINTING}, world=1),
    "v1_settings": Variant({**V1, "plan.xla_fsdp_settings": '{"shard_param_on_dim_0": true, '
                                                            '"pin_layout_in_collective_ops": false}'}, world=1),
}

# What the default suite runs per backend; everything else a backend honours runs under `slow`.
DEFAULT = {
    "cpu": ["base", "reshard_off", "cpu_offload", "activation_checkpointing", "bf16", "size_based_wrap", "no_wrap",
            "batch8", "batch8_accum4", "rank0_loading", "tied", "documents", "tied_rank0_loading",
            "cp2_allgather", "cp2_alltoall", "documents_cp2_allgather", "documents_cp2_alltoall",
            "fsdp2_cp2_allgather", "fsdp2_cp2_alltoall", "fsdp2_cp2_alltoall_checkpointing", "cp4_allgather",
            "cp4_alltoall_contiguous", "tp2", "ddp2", "loss_chunks", "unchunked_loss"],
    "xla": ["base", "activation_checkpointing", "fsdp4", "fsdp4_checkpointing", "fsdp2_cp2_allgather", "fsdp2_tp2",
            "v1", "loss_chunks"],
    "flax": ["base", "batch8_accum4", "activation_checkpointing", "cp2_allgather", "fsdp2_tp2", "loss_chunks"],
}


def make_config(overrides: dict):
    """The test recipe with `--config.KEY=VALUE` overrides (values as the command line writes them)."""
    config = load_recipe(RECIPE)
    for key, value in overrides.items():
        apply_override(config, key, command_line_text(value))
    return config


def honours(backend: str, name: str) -> bool:
    """Whether `backend` runs variant `name` as written: no setting refused, none without effect."""
    variant = VARIANTS[name]
    config = make_config(variant.overrides)
    plan = plan_from_config(config)
    context = capability_context(config, plan, "cpu", variant.world)
    target = capabilities.target_for(backend, plan.xla.xla_fsdp_v2)
    return not any(isinstance(verdict, (capabilities.Refused, capabilities.NoEffect))
                   for _, verdict in capabilities.verdicts(context, target))


def variants_for(backend: str, *, slow: bool = False, world: int | None = None) -> list:
    """The default variants of `backend` (or, with slow=True, the rest of what it honours), in matrix order."""
    names = [n for n in VARIANTS if honours(backend, n) and (n in DEFAULT[backend]) != slow]
    return [n for n in names if world is None or VARIANTS[n].world == world]
