"""portable_fsdp: one sharding plan, lowered to torch FSDP2, torch_xla and JAX."""
# The Python API (portable_fsdp/api.py), loaded on first use so that `import portable_fsdp` stays light.
_API = ("get_config", "from_training_arguments", "plan_for", "load_backend", "init", "Batches", "evaluate", "save", "load",
        "train", "RunFailed", "StopTraining", "EarlyStopping", "LossInputs")


def __getattr__(name):
    if name in _API:
        from portable_fsdp import api

        return getattr(api, name)
    raise AttributeError(f"module 'portable_fsdp' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
