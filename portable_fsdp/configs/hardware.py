"""What the big-model recipes share: a variant per machine a user has, and the smoke variant that shrinks the
same architecture to CPU size. Each recipe declares its variants as data (`Variant`) and calls `build`."""
from __future__ import annotations

import dataclasses

from portable_fsdp.config.schema import DEFAULT_RECIPE, apply_override, base_config, command_line_text, import_recipe
from portable_fsdp.errors import notify


@dataclasses.dataclass(frozen=True)
class Variant:
    """One machine: the backend, processes and device (a DEVICE_MEMORY key) to launch with, and the config fields
    that fit it there."""

    backend: str
    nproc: int
    device: str
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
             "plan.state_dict_type": "SHARDED_STATE_DICT", "train.export_full_at_end": True,
             # the bundled corpus trains in minutes; a real one is a hub dataset id (downloaded online), e.g.
             # "data.source": "HuggingFaceFW/fineweb-edu", "data.name": "sample-10BT",
             "data.source": "bundled"}

# The same architecture at CPU size (the heads-to-kv-heads ratio kept); trains in seconds on --backend cpu.
SMOKE = {"model.hidden_size": 64, "model.intermediate_size": 160, "model.num_hidden_layers": 2,
         "model.vocab_size": 384, "model.max_position_embeddings": 128, "data.seq_len": 64,
         "train.steps": 4, "train.batch_size": 4, "train.eval_batch_size": 4, "train.eval_every": 0,
         "train.eval_max_batches": 2, "train.log_every": 1, "train.warmup_steps": 1, "train.progress_bar": False}
SMOKE_LAUNCH = Variant("cpu", 2, "cpu", {})


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


def recipe_variant(spec: str | None) -> Variant | None:
    """The Variant `recipe.py:name` names (SMOKE_LAUNCH for smoke); None for a recipe without variants or a spec
    naming none."""
    path, _, name = (spec or DEFAULT_RECIPE).partition(":")
    variants = getattr(import_recipe(path), "VARIANTS", None)
    if variants is None or not name:
        return None
    return SMOKE_LAUNCH if name == "smoke" else variants.get(name)


def launch_flags(spec: str | None, **given):
    """The command's launch flags (backend, nproc, device), those left unset ("auto" or None) taken from the recipe
    variant. A flag that differs from the variant wins, with one notice (none for smoke, which every backend trains):
    estimating a recipe sized for one machine on another is a fair question, but the variant's settings were not
    chosen for it."""
    variant = recipe_variant(spec)
    if variant is None:
        return tuple(given.values())
    chosen = []
    for flag, value in given.items():
        wanted = getattr(variant, flag)
        if value not in ("auto", None) and value != wanted and variant is not SMOKE_LAUNCH:  # smoke runs anywhere
            notify(f"--{flag} {value} is used, not the {wanted} that variant {spec.partition(':')[2]} is sized for")
        chosen.append(wanted if value in ("auto", None) else value)
    return tuple(chosen)
