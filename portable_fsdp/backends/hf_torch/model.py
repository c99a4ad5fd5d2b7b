"""Building the transformers model both torch-based lowerings train: random init of any transformers causal-LM
architecture (by model_type and the config's sizes, or from a config.json), or the weights of a local
`from_pretrained` directory or hub id, optionally on rank 0 only (`cpu_ram_efficient_loading`)."""
from __future__ import annotations

import difflib
import pathlib
import re
import warnings

import torch

from portable_fsdp.checkpoint import layout as checkpointing, safetensors_shards
from portable_fsdp.backend import ModelInfo
from portable_fsdp.backends.hf_torch import custom_model, deferred_init, experts
from portable_fsdp.errors import UserError
from portable_fsdp.training.parts import NONE as NO_PARTS, Parts


# The model fields a random init takes from the config (every family's config.json has them by these names or
# maps them onto its own, e.g. GPT-2's n_embd).
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
               "initializer_range")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def hf_config(model_cfg):
    """The transformers config of the run's model: `init_from`'s (weights to load), else `config_from`'s (random
    init of that config.json), else `architecture` built from the size fields; `config_overrides` on top."""
    if model_cfg.init_from:
        config = _stored_config(model_cfg.init_from, "model.init_from")
    elif model_cfg.config_from:
        config = _stored_config(model_cfg.config_from, "model.config_from")
    else:
        config = config_for_architecture(model_cfg.architecture, {name: model_cfg[name] for name in SIZE_FIELDS})
    for key, value in model_cfg.config_overrides.to_dict().items():
        setattr(config, key, value)
    config._attn_implementation = model_cfg.attn_implementation
    return config


def config_for_architecture(architecture: str, sizes: dict):
    """A transformers config of `architecture` (a model_type with a causal-LM model) with these sizes."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if architecture not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        known = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        close = difflib.get_close_matches(architecture, known, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise UserError("model.architecture", (
            f"{architecture!r} is not a transformers causal-LM model_type; {hint}e.g. llama, qwen2, mistral, "
            f"mixtral, qwen3_moe, gemma ({len(known)} in all)"))
    return AutoConfig.for_model(architecture, **sizes)


def _stored_config(source: str, field: str):
    """The config.json of a local directory (or the file itself), or of a hub id when the hub can be reached."""
    from transformers import AutoConfig

    path = pathlib.Path(source)
    if path.is_file() and path.suffix == ".json":
        return AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path)
    if path.is_dir():
        if (path / checkpointing.SHARDED).is_dir() and not any(path.glob("*.safetensors")):
            raise UserError(field, (
                f"{path} is a SHARDED_STATE_DICT checkpoint, which loads only into FSDP (resume it with "
                f"train.resume) — convert it first: python -m portable_fsdp.convert {path} OUT_DIR"))
        if not (path / "config.json").is_file():
            raise UserError(field, f"{path} is not a local model directory (no config.json)")
        if field == "model.init_from":  # an index naming a missing file: one line, before anything is built
            safetensors_shards.weight_files(path, field)
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if not HUB_ID.match(source):
        raise UserError(field, f"{source} is not a local model directory (no config.json) or a hub id (org/name)")
    try:
        return AutoConfig.from_pretrained(source)
    except OSError as err:
        reason = "HF_HUB_OFFLINE is set" if _hub_offline() else str(err).splitlines()[0]
        raise UserError(field, (
            f"{source} is not a local directory and could not be read from the Hugging Face hub ({reason}); "
            f"download it where there is a network (hf download {source} --local-dir DIR) and set "
            f"{field}=DIR")) from None


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def describe_model(config, parts: Parts = NO_PARTS) -> ModelInfo:
    """The ModelInfo of the run's model: the user's module when one is passed in, else the config's."""
    if parts.model is not None:
        return custom_model.describe(parts.model)
    from transformers import AutoModelForCausalLM

    cfg = hf_config(config.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    unique = {id(p): p.numel() for p in model.parameters()}
    # The embedding tables (token and any position table) are lookups, left out of MFU's 6·N — except one
    # tied to the lm_head, whose matmul it is: that one is counted in N.
    output = model.get_output_embeddings()
    tied = {id(p) for p in output.parameters()} if output is not None else set()
    embedding = {id(p): p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)
                 for p in m.parameters() if id(p) not in tied}
    inner: dict = {}
    for module in model.modules():
        inner.setdefault(type(module).__name__, set()).update(
            type(child).__name__ for child in module.modules() if child is not module)
    return ModelInfo(
        class_names=tuple(sorted(inner)),
        no_split_modules=tuple(model._no_split_modules or ()),
        n_params=sum(unique.values()), n_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, n_embedding_params=sum(embedding.values()), root_class=type(model).__name__,
        inner_classes={name: tuple(sorted(classes)) for name, classes in inner.items()},
        n_routed_expert_params=experts.routed_expert_params(model), experts_per_token=experts.experts_per_token(cfg),
        **family_settings(cfg))


# Where each family's config.json keeps the dropout on attention probabilities.
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def family_settings(cfg) -> dict:
    """The ModelInfo fields start-up checks read from the model's own config: model_type, its attention
    dropout (and the key that sets it), and its shortest sliding attention window (0: none)."""
    key = next((k for k in ATTENTION_DROPOUT_KEYS if getattr(cfg, k, None) is not None), "")
    layer_types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None) or 0
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = 0  # a window in config.json that no layer uses (Qwen2 with use_sliding_window=false)
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    return {"model_type": cfg.model_type, "attention_dropout": float(getattr(cfg, key, 0.0) or 0.0) if key else 0.0,
            "attention_dropout_key": key, "sliding_window": int(window), "num_attention_heads": heads,
            "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "num_experts": num_experts(cfg), "tp_plan": dict(getattr(cfg, "base_model_tp_plan", None) or {})}


# Where each MoE family's config.json keeps its number of routed experts.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def num_experts(cfg) -> int:
    """Routed experts per MoE layer (0: a dense model)."""
    return int(next((getattr(cfg, k) for k in EXPERT_COUNT_KEYS if getattr(cfg, k, None)), 0))


def create_model(config, rank: int, rank0_only: bool):
    """The unsharded model on CPU in fp32 — or on the meta device on ranks other than 0 when
    `rank0_only`, to be filled from rank 0 once sharded (portable_fsdp/backends/torch: broadcast_from_rank0)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(config.model)
    if rank0_only and rank != 0:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    torch.manual_seed(config.seed)  # every rank (and a 1-process run) starts from the same weights
    if config.model.init_from:
        local = pathlib.Path(config.model.init_from).is_dir()  # else a hub id, read through the hub's cache
        return AutoModelForCausalLM.from_pretrained(config.model.init_from, config=cfg, local_files_only=local,
                                                    dtype=torch.float32)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def create_on_meta(config) -> deferred_init.OnMeta | None:
    """The model of `create_model` with no parameter allocated: the seeded random init, replayed one parameter
    at a time, or the weights of a local directory of safetensors files, read one tensor at a time. None when
    that cannot give `create_model`'s values bit for bit (an init the replay cannot reproduce: one line says
    so; a checkpoint whose names are not the model's, which from_pretrained converts): the caller builds the
    model whole."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(config.model)

    def build():
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)

    if config.model.init_from:
        with torch.device("meta"):
            model = build()
        fill = _safetensors_fill(model, pathlib.Path(config.model.init_from))
        return deferred_init.OnMeta(model, fill, deferred_init.computed_buffers(build)) if fill else None
    try:
        model, recording = deferred_init.build_on_meta(build)
    except deferred_init.Unsupported as why:
        warnings.warn(f"every rank builds the whole model before sharding it: its init cannot be replayed "
                      f"shard by shard ({why})", stacklevel=2)
        return None
    return deferred_init.OnMeta(model, lambda deliver: deferred_init.replay(recording, config.seed, deliver),
                  deferred_init.computed_buffers(build))


def _safetensors_fill(model, directory: pathlib.Path):
    """A `fill` reading each parameter from the directory's safetensors files when their tensor names are
    exactly the model's parameters (a tied copy may be left out), else None."""
    files = safetensors_shards.weight_files(directory, "model.init_from") if directory.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    names: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = {name: group for group in names.values() for name in group}
    stored = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            stored.update(f.keys())
    if not stored <= set(tied) or any(not stored & set(group) for group in names.values()):
        return None

    def fill(deliver):
        delivered = set()
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    group = tied[key]
                    if group[0] not in delivered:
                        delivered.add(group[0])
                        deliver(group, f.get_tensor(key).to(torch.float32))

    return fill


def enable_gradient_checkpointing(model, checkpoint_function=None) -> None:
    """train.gradient_checkpointing: transformers' own checkpointing of every layer — torch's non-reentrant
    checkpoint, or `checkpoint_function` in its place (torch_xla's, behind an optimization barrier, without which
    XLA folds the recomputation back into the forward and saves no memory)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})  # (transformers 5.24 deprecates the second name)
    if checkpoint_function is not None:
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint_function)


def freeze_parameters(model, patterns: list) -> None:
    """Set requires_grad=False on parameters whose name matches any of the regexes (train.freeze)."""
    import re

    regexes = [re.compile(p.strip()) for p in patterns if p.strip()]
    names = [name for name, _ in model.named_parameters()]
    for regex in regexes:
        if not any(regex.search(name) for name in names):
            raise UserError("train.freeze", f"{regex.pattern!r} matches no parameter; names look like {', '.join(names[:3])}")
    for name, param in model.named_parameters():
        if any(regex.search(name) for regex in regexes):
            param.requires_grad_(False)


def full_state_dict_with_ties(model, state_dict: dict) -> dict:
    """Checkpoints omit tied copies (HF writes `lm_head.weight` once, as the embedding); put them back."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if isinstance(tied, dict):
        for target, source in tied.items():
            if target not in state_dict and source in state_dict:
                state_dict[target] = state_dict[source]
    return state_dict
