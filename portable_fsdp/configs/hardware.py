"""What the big-model recipes share: a variant per machine a user has, and the smoke variant that shrinks the
same architecture to CPU size. Each recipe declares its variants as data (`Variant`) and calls `build`."""
from __future__ import annotations

import dataclasses

from portable_fsdp.config.schema import apply_override, base_config, command_line_text


@dataclasses.dataclass(frozen=True)
class Variant:
    """One machine: the backend and processes to launch with, and the config fields that fit it there."""

    backend: str
    nproc: int
    settings: dict

    def command(self, recipe: str, name: str) -> str:
        return (f"python -m portable_fsdp.run --config portable_fsdp/configs/{recipe}.py:{name} --backend {self.backend} "
                f"--nproc {self.nproc}")


# bf16 compute with fp32 gradient reduction and fp32 master weights (FSDP2's mixed precision), activation
# checkpointing, whole-run settings a real training starts from.
REAL_SIZE = {"plan.param_dtype": "bfloat16", "plan.reduce_dtype": "float32",
             "plan.activation_checkpointing": True, "model.attn_implementation": "sdpa",
             "train.steps": 1000, "train.eval_every": 200, "train.eval_max_batches": 20, "train.save_every": 500,
             "train.log_every": 10, "train.warmup_steps": 100, "train.lr": 3e-4,
             "plan.state_dict_type": "SHARDED_STATE_DICT", "train.export_full_at_end": True}

# The same architecture at CPU size (the heads-to-kv-heads ratio kept); trains in seconds on --backend cpu.
SMOKE = {"model.hidden_size": 64, "model.intermediate_size": 160, "model.num_hidden_layers": 2,
         "model.vocab_size": 384, "model.max_position_embeddings": 128, "data.seq_len": 64,
         "train.steps": 4, "train.batch_size": 4, "train.eval_batch_size": 4, "train.eval_every": 0,
         "train.eval_max_batches": 2, "train.log_every": 1, "train.warmup_steps": 1, "train.progress_bar": False}
SMOKE_LAUNCH = ("cpu", 2)


def build(architecture: dict, variants: dict, smoke: dict, name: str):
    """The config of variant `name`: the architecture's model fields, then the variant's settings (`smoke`: the
    architecture's own smoke sizes over SMOKE). An unknown name is a ValueError listing the variants."""
    if name != "smoke" and name not in variants:
        raise ValueError(f"unknown variant {name!r}; choose one of {', '.join([*variants, 'smoke'])}")
    config = base_config()
    settings = {**architecture, **(SMOKE | smoke if name == "smoke" else REAL_SIZE | variants[name].settings)}
    for key, value in settings.items():
        apply_override(config, key, command_line_text(value))
    return config
