"""Every model family trains on --backend xla (SPMD FSDPv2 over 2 PJRT CPU devices) from `model.init_from`, with
the losses of a single-process plain-torch run of the same model (tests/parity/families.py). Mixtral is the
case xla needed a fix for (backends/xla/moe.py); Qwen2 runs by default too, the other families are slow."""
import pytest

from tests.parity import families
from tests.xla.test_cli import ENV

FAMILIES = [pytest.param(f, marks=() if f in ("qwen2", "mixtral") else pytest.mark.slow) for f in families.FAMILIES]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_like_plain_torch_on_xla(family, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    families.assert_trains_like_plain_torch("xla", model, tmp_path, env=ENV)
