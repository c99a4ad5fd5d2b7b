"""portable_fsdp: one sharding plan, lowered to torch FSDP2, torch_xla and JAX."""
import os as _os

# The product's layout keeps backends/ and configs/ beside this package; the build installs them as
# portable_fsdp.backends and portable_fsdp.configs. A source checkout gets the same names here.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "backends")) and _os.path.isfile(
        _os.path.join(_checkout, "backends", "__init__.py")):
    __path__.append(_checkout)


# The Python API (portable_fsdp/api.py), loaded on first use so that `import portable_fsdp` stays light.
_API = ("get_config", "plan_for", "load_backend", "Batches", "evaluate", "save", "load", "train", "RunFailed")


def __getattr__(name):
    if name in _API:
        from portable_fsdp import api

        return getattr(api, name)
    raise AttributeError(f"module 'portable_fsdp' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
