"""Every model family trains on --backend xla (SPMD FSDPv2 over 2 PJRT CPU devices) from `model.init_from`, with
the losses of a single-process plain-torch run of the same model (tests/parity/families.py). Mixtral is the
case xla needed a fix for (backends/xla/moe.py); Qwen2 runs by default too, the other families are slow."""
import pytest

from tests.conftest import cli
from tests.parity import families
from tests.parity.reference import max_relative_difference
from tests.xla.test_cli import ENV

FAMILIES = [pytest.param(f, marks=() if f in ("qwen2", "mixtral") else pytest.mark.slow) for f in families.FAMILIES]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_like_plain_torch_on_xla(family, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    proc = cli(["--backend", "xla", "--nproc", "2", *families.cli_args(model, tmp_path / "run")], cwd=tmp_path,
               env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = families.losses(tmp_path / "run")
    assert len(losses) == families.STEPS
    assert max_relative_difference(losses, families.reference(model)) <= families.RTOL
