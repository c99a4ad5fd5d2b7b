"""portable_fsdp: one sharding plan, lowered to torch FSDP2, torch_xla and JAX."""
import os as _os

# The product's layout keeps backends/ and configs/ beside this package; the build installs them as
# portable_fsdp.backends and portable_fsdp.configs. A source checkout gets the same names here.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "backends")) and _os.path.isfile(
        _os.path.join(_checkout, "backends", "__init__.py")):
    __path__.append(_checkout)
