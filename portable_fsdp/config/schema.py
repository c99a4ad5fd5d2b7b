"""The config schema (an ml_collections ConfigDict), recipe loading and `--config.a.b=value` overrides.

`base_config()` is the schema: every field a run understands, with its default and type, and its meaning in the
comment beside it or just above (what `--help` lists; plan fields carry theirs in portable_fsdp/plan.py). Recipes in
`portable_fsdp/configs/` start from it and change values; the command line may change any field but add none.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import math
import pathlib
import re

import ml_collections

from portable_fsdp import plan as plan_lib
from portable_fsdp.errors import UserError

DEFAULT_RECIPE = "llama_tiny"
# Fields whose value is a mapping (a ConfigDict of free keys, set whole: from JSON on the command line).
MAPPING_FIELDS = frozenset({"model.config_overrides",
                            *(f"plan.{f.name}" for f in plan_lib.plan_fields() if isinstance(f.default, dict))})


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # initial weights, data order and dropout

    c.model = ml_collections.ConfigDict()
    c.model.init_from = ""  # weights: a local Hugging Face model directory, or (online) a hub id; empty = random init
    c.model.architecture = "llama"  # random init: a transformers model_type (llama, qwen2, mistral, mixtral, ...)
    c.model.config_from = ""  # random init from a config.json (a file, its directory, or online a hub id): its sizes
    c.model.config_overrides = mapping({})  # config.json keys set on top of any of these, e.g. {"num_local_experts": 8}
    c.model.vocab_size = 384  # random init: the model's sizes (a config.json or init_from sets its own)
    c.model.hidden_size = 128  # width of the residual stream
    c.model.intermediate_size = 352  # width of the MLP
    c.model.num_hidden_layers = 4  # decoder layers
    c.model.num_attention_heads = 4  # query heads
    c.model.num_key_value_heads = 2  # key/value heads (fewer than query heads: grouped-query attention)
    c.model.max_position_embeddings = 1024  # longest sequence the model is built for
    c.model.rope_theta = 10000.0  # base of the rotary position embedding
    c.model.rms_norm_eps = 1e-6  # epsilon of the RMS norms
    c.model.tie_word_embeddings = False  # the output projection shares the input embedding table
    c.model.initializer_range = 0.02  # standard deviation of random init
    c.model.attn_implementation = "sdpa"  # transformers' attention kernel: sdpa, eager, ...
    # Parameter-efficient fine-tuning with peft (`pip install 'portable_fsdp[peft]'`; cpu/cuda): the base model
    # frozen, only the adapters trained, saved and given optimizer state
    c.model.peft = ml_collections.ConfigDict()
    c.model.peft.type = ""  # "" = no adapters (the whole model trains); lora
    c.model.peft.r = 8  # the adapters' rank (peft's LoraConfig r)
    c.model.peft.alpha = 16  # the adapters' scale is alpha / r (LoraConfig lora_alpha)
    c.model.peft.dropout = 0.0  # dropout on the adapters' input (LoraConfig lora_dropout)
    # module names to adapt (LoraConfig target_modules; CLI: comma-separated, e.g. q_proj,v_proj); [] = peft's
    # default for the model's family (Llama: q_proj, v_proj)
    c.model.peft.target_modules = []

    c.data = ml_collections.ConfigDict()
    # "bundled", a local text file, a local `datasets` file (.jsonl/.csv/.parquet) / save_to_disk directory, or a hub
    # dataset id org/name (downloaded online, else read from the Hugging Face cache)
    c.data.source = "bundled"
    c.data.name = ""  # a hub dataset's configuration
    c.data.split = "train"  # the split of a hub dataset or a saved DatasetDict
    c.data.revision = ""  # a hub dataset's branch, tag or commit; empty = main
    c.data.text_column = "text"  # format=text: the column holding the documents
    # "text", or "chat": rows of messages rendered by the tokenizer's chat template, the loss on assistant tokens only
    c.data.format = "text"
    c.data.messages_column = "messages"  # format=chat: the column of [{role, content}, ...]
    # "byte", a local tokenizer directory or (online) a hub id (AutoTokenizer.from_pretrained); empty = the
    # tokenizer of model.init_from when it names a hub model or a directory holding one, else "byte"
    c.data.tokenizer = ""
    c.data.seq_len = 128  # tokens per training sequence (documents are packed)
    c.data.eval_fraction = 0.05  # the share of documents held out for evaluation
    c.data.document_masking = False  # packed documents attend only within themselves (position ids restart)
    # the token cache (portable_fsdp/data/cache.py): "" = $PORTABLE_FSDP_DATA_CACHE or ~/.cache/portable_fsdp/data
    c.data.cache_dir = ""
    c.data.num_proc = 0  # processes that tokenise into the cache; 0 = one per CPU (at most 16)
    c.data.streaming = False  # read, tokenise and pack the corpus while training (no cache), in corpus order
    c.data.eval_sequences = 64  # streaming: the stream's first sequences, held out as the eval split

    c.train = ml_collections.ConfigDict()
    c.train.steps = 300  # optimizer steps of the run; 0 = as many as train.epochs take
    # passes over the train split, with train.steps=0: ceil(epochs x train sequences / train.batch_size) steps
    c.train.epochs = 0.0
    c.train.batch_size = 8  # global sequences per optimizer step
    c.train.grad_accum_steps = 1  # micro-batches per optimizer step
    c.train.eval_batch_size = 8  # global sequences per eval step
    c.train.eval_every = 100  # evaluate every this many steps (and at the end); 0 = only at the end
    c.train.eval_max_batches = 0  # 0 = the whole eval split
    # "", "token_accuracy", "package.module:function(predictions, labels) -> dict" or Hugging Face Trainer's
    # "package.module:function(eval_prediction) -> dict", which receives logits (training/evaluation.py)
    c.train.compute_metrics = ""
    # Trainer's "package.module:function(logits, labels) -> array": what such a compute_metrics receives instead
    # of the logits, applied to each eval batch on each rank before the rows are gathered
    c.train.preprocess_logits_for_metrics = ""
    c.train.early_stopping_patience = 0  # stop after this many evals without a better eval_loss; 0 = never
    c.train.load_best_model_at_end = False  # end with the weights of the best eval_loss (kept on disk as `best`)
    c.train.log_every = 10  # a metrics record (and a progress line) every this many steps
    c.train.save_every = 0  # 0 = only at the end
    c.train.keep_last_n = 2  # checkpoints kept; older ones are deleted
    # FULL checkpoints: weights split into safetensors files of at most this size (+ an index), as save_pretrained
    # does (5GB: what hub models use; transformers 5's own default is 50GB), and stored in save_dtype: float32 |
    # bfloat16 (half the bytes; a resume casts back and is not bit-exact)
    c.train.max_shard_size = "5GB"
    c.train.save_dtype = "float32"  # FULL checkpoints' weights: float32 or bfloat16 (see train.max_shard_size)
    # SHARDED saves on cpu/cuda: write in the background while training goes on (committed once every rank wrote)
    c.train.async_save = False
    # SHARDED_STATE_DICT runs: once the last step is done (train.steps reached, or early stopping), also write
    # WORKDIR/export/, the model as from_pretrained loads it (weights in save_dtype, config, tokenizer; no
    # optimizer state). Not after train.stop_at_step or an interrupt (the run goes on later). FULL: a no-op, but
    # with model.peft (whose checkpoints hold the adapters alone) on either: the base with the adapters merged in
    c.train.export_full_at_end = False
    c.train.resume = False  # continue from the workdir's latest checkpoint
    c.train.save_on_interrupt = True  # on SIGINT/SIGTERM: finish the step, save a checkpoint, exit 130
    c.train.stop_at_step = 0  # end this run (with a checkpoint) after that step; resume later. 0 = run to train.steps
    c.train.lr = 3e-3  # peak learning rate
    c.train.min_lr_ratio = 0.1  # the schedule ends at this fraction of train.lr
    # after the warm-up: cosine or linear decay to min_lr_ratio * lr, constant, or wsd (warmup-stable-decay: constant,
    # then a linear decay to min_lr_ratio * lr over the last decay_ratio of train.steps)
    c.train.lr_schedule = "cosine"
    c.train.decay_ratio = 0.2  # wsd only: the share of train.steps the final decay takes
    c.train.optimizer = "adamw"  # adamw | adafactor | lion | sgd (docs/optimizers.md: the fields each reads)
    c.train.warmup_steps = 20  # linear warm-up from 0 to train.lr
    c.train.weight_decay = 0.1  # decoupled weight decay (AdamW, Adafactor, Lion); L2 on the gradient for SGD
    c.train.beta1 = 0.9  # first-moment decay (AdamW, Lion)
    c.train.beta2 = 0.95  # second-moment decay (AdamW; Lion's momentum update)
    c.train.eps = 1e-8  # AdamW's epsilon
    c.train.momentum = 0.0  # sgd only
    c.train.max_grad_norm = 1.0  # 0 = no clipping
    c.train.nonfinite = "stop"  # a NaN/inf loss or gradient: "stop" (error naming the step) or "skip" the update
    c.train.freeze = []  # regexes of parameter names to keep frozen (e.g. ["embed_tokens"]; CLI: comma-separated)
    c.train.gradient_checkpointing = False  # the model's own; prefer plan.activation_checkpointing
    # tokens per device whose logits the training and eval loss computes at once (the output projection and
    # cross-entropy a chunk at a time, never a whole micro-batch's logits); 0 = all at once
    c.train.loss_chunk_tokens = 1024
    # [FIRST, LAST] (CLI: FIRST,LAST): trace train steps FIRST..LAST (from 1) with the backend's profiler into
    # WORKDIR/profile (TensorBoard's profiler plugin, Perfetto); [] = no trace
    c.train.profile_steps = []
    # cuda: record the allocator's history; a step that runs out of memory first writes it to
    # WORKDIR/memory_snapshot.pickle (pytorch.org/memory_viz). Always on while train.profile_steps traces
    c.train.memory_snapshot = False
    c.train.peak_flops_per_device = 0.0  # for MFU; 0 = measure a matmul (CPU) or look up the GPU
    # rank 0's progress: a bar on a terminal; in a file, SLURM or k8s log one key=value line per train.log_every step
    c.train.progress_bar = True
    # rank 0's records also go to: none, all (every one installed), tensorboard, wandb, or tensorboard,wandb
    c.train.report_to = "none"
    c.train.wandb_project = ""  # report_to=wandb: the W&B project; empty = "portable_fsdp"
    c.train.collective_timeout_s = 300  # seconds a rank waits in a collective before the run fails naming it
    c.train.check_fit = False  # estimate memory per rank first (portable_fsdp.estimate); refuse a run that cannot fit

    # Declared once, in portable_fsdp/plan.py: defaults, meanings and the Hugging Face keys that set them.
    c.plan = ml_collections.ConfigDict({f.name: mapping(f.config_default) if isinstance(f.default, dict)
                                        else f.config_default for f in plan_lib.plan_fields()})
    return c


def field_meanings() -> dict:
    """{"section.field": meaning} of every field: base_config's comments and the plan fields' docs."""
    meanings, above = {}, []
    for line in inspect.getsource(base_config).splitlines():
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# "))
            continue
        assigned = re.match(r"c\.([\w.]+) = .*?(?:  # (.*))?$", text)
        if assigned:
            meanings[assigned[1]] = " ".join(above + [assigned[2] or ""]).strip()
        above = []
    meanings.update({f"plan.{f.name}": f.doc for f in plan_lib.plan_fields()})
    return {field: meanings[field] for field in _all_fields(base_config())}  # sections carry no meaning


def mapping(value: dict) -> ml_collections.ConfigDict:
    """A mapping field's value: its keys are free text (module patterns such as `layers.*.mlp.up_proj`)."""
    return ml_collections.ConfigDict(dict(value), allow_dotted_keys=True)


def from_dict(data: dict) -> ml_collections.ConfigDict:
    """A config from its `to_dict()` (what a worker receives), mapping fields keeping their dotted keys."""
    sections = {section: {name: mapping(value) if f"{section}.{name}" in MAPPING_FIELDS else value
                          for name, value in data[section].items()}
                for section in ("model", "plan") if section in data}
    return ml_collections.ConfigDict({**data, **sections})


def load_recipe(spec: str | None) -> ml_collections.ConfigDict:
    """`path/to/recipe.py[:arg]` (or a bundled recipe name) -> the ConfigDict its get_config(arg) returns."""
    spec = spec or DEFAULT_RECIPE
    path, _, arg = spec.partition(":")
    module = import_recipe(path)
    if not hasattr(module, "get_config"):
        raise UserError("--config", f"{path} defines no get_config(arg) function")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except (ValueError, TypeError, KeyError) as err:
        raise UserError("--config", f"{path}: get_config({arg!r}) failed: {err}") from None
    _check_same_schema(config, base_config(), "")
    config.lock()
    return config


def import_recipe(path: str):
    """The module of a recipe file or bundled recipe name."""
    file = pathlib.Path(path)
    if file.suffix == ".py":
        if not file.is_file():
            raise UserError("--config", f"no such recipe file {path}; give a path like portable_fsdp/configs/llama_tiny.py")
        spec = importlib.util.spec_from_file_location(f"portable_fsdp_recipe_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(f"portable_fsdp.configs.{path}")
    except ModuleNotFoundError:
        raise UserError("--config", f"no bundled recipe {path!r}; give a .py file such as portable_fsdp/configs/llama_tiny.py") from None


def _check_same_schema(config, schema, prefix: str) -> None:
    for key in config.keys():
        if key not in schema:
            raise UserError(f"config.{prefix}{key}", "is not a field of the schema (portable_fsdp/config/schema.py)")
        if _is_section(schema[key], f"{prefix}{key}"):
            _check_same_schema(config[key], schema[key], f"{prefix}{key}.")


def apply_override(config: ml_collections.ConfigDict, dotted: str, raw: str) -> None:
    """Set `config.<dotted>` from its command-line text, typed by the field's current value."""
    *parents, leaf = dotted.split(".")
    node = config
    for depth, name in enumerate(parents):
        if name in node and not _is_section(node[name], ".".join(parents[: depth + 1])):
            section = ".".join(parents[: depth + 1])
            raise UserError(f"config.{dotted}", f"config.{section} is a value, not a section; set --config.{section}=...")
        if name not in node:
            _unknown(config, dotted)
        node = node[name]
    if leaf not in node:
        _unknown(config, dotted)
    if _is_section(node[leaf], dotted):
        raise UserError(f"config.{dotted}", "is a section; set one of its fields, e.g. "
                        f"--config.{dotted}.{next(iter(node[leaf].keys()))}=...")
    _assign(node, leaf, parse_value(raw, node[leaf], f"config.{dotted}"))


def _assign(node, leaf: str, value) -> None:
    """Set a checked value in a locked section (a mapping keeps its dotted keys)."""
    with node.unlocked():
        node[leaf] = mapping(value) if isinstance(value, dict) else value


def command_line_text(value) -> str:
    """A Python value as the command line writes it (`--config.a.b=TEXT`): true/false, A,B for a list, JSON for
    a mapping."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def set_field(config: ml_collections.ConfigDict, dotted: str, value, source: str) -> None:
    """Set a field from an already-parsed value (fsdp.json, Accelerate YAML), checking its type. A list field
    also takes one comma-separated string, as Hugging Face's files write class lists."""
    *parents, leaf = dotted.split(".")
    node = config
    for name in parents:
        node = node[name]
    expected = node[leaf]
    if isinstance(expected, list) and isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if dotted in MAPPING_FIELDS:
        if not isinstance(value, dict):
            raise UserError(source, f"must be a JSON object (got {value!r})")
    elif isinstance(expected, list):
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise UserError(source, f"must be a list of names, e.g. class names (got {value!r})")
    elif isinstance(expected, bool) != isinstance(value, bool) or not isinstance(value, type(expected)):
        if isinstance(expected, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        else:
            raise UserError(source, f"must be a {type(expected).__name__} (got {value!r})")
    _assign(node, leaf, value)


def parse_value(raw: str, current, field: str):
    kind = type(current)
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(raw)
        if kind is float:
            value = float(raw)
            if not math.isfinite(value):
                raise UserError(field, f"expects a finite number, got {raw!r}")
            return value
        if kind is str:
            return raw
        if kind is list:  # comma-separated, as Hugging Face writes class lists
            return [part.strip() for part in raw.split(",") if part.strip()]
        if kind is ml_collections.ConfigDict or kind is dict:
            return _json_object(raw, field)
    except ValueError:
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise UserError(field, f"expects {article} {kind.__name__}, got {raw!r}") from None
    raise UserError(field, f"cannot be set from the command line (type {kind.__name__})")


def _json_object(raw: str, field: str) -> dict:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(field, f"is not a JSON object ({err.msg})") from None
    if not isinstance(value, dict):
        raise UserError(field, "must be a JSON object such as {\"compute_dtype\": \"bfloat16\"}")
    return value


def _unknown(config, dotted: str) -> None:
    known = sorted(_all_fields(config))
    close = difflib.get_close_matches(dotted, known, n=1)
    hint = f"; did you mean config.{close[0]}?" if close else "; see portable_fsdp/config/schema.py for the fields"
    raise UserError(f"config.{dotted}", f"unknown field{hint}")


def _is_section(value, dotted: str) -> bool:
    return isinstance(value, ml_collections.ConfigDict) and dotted not in MAPPING_FIELDS


def _all_fields(config, prefix: str = ""):
    for key, value in config.items():
        if _is_section(value, f"{prefix}{key}"):
            yield from _all_fields(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def flat_fields(config) -> dict:
    """{"section.field": value} of every field; mapping fields as plain dicts."""
    flat = {}
    for dotted in _all_fields(config):
        section, _, name = dotted.rpartition(".")
        value = config[section][name] if section else config[name]
        flat[dotted] = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
    return flat
