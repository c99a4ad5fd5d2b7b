"""What both torch-based lowerings (portable_fsdp/backends/torch: FSDP2 on cpu/cuda; portable_fsdp/backends/xla: torch_xla) share: the
transformers model (`model`), the loss and its accumulation over micro-batches (`loss`), and the AdamW
update (`optimizer`). Nothing here shards or communicates: each backend does that around these pieces.
"""
import os

# Set before transformers is first imported (through this package, by both torch-based backends): it must not
# probe torch_xla (the xla backend's model code is the same either way). The hub is reached only for a hub id
# in model.init_from / model.config_from; local directories are read with local_files_only.
os.environ.setdefault("USE_TORCH_XLA", "0")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
