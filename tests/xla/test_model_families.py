"""Every model family trains on --backend xla (SPMD FSDPv2 over 2 PJRT CPU devices) from `model.init_from`, with
the losses of a single-process plain-torch run of the same model (tests/parity/families.py). Mixtral is the
case xla needed a fix for (portable_fsdp/backends/xla/moe.py) and runs by default; the other families are slow (Qwen2 runs by
default on cpu and flax).
Slow too: the mesh axes on the families that need them — Qwen2 (q/k/v biases) with tensor and with Ulysses
sequence parallelism, Mixtral with its experts split over ep devices (alone and with fsdp 4 = 2 x ep 2)."""
import pytest

from tests.parity import families
from tests.xla.test_cli import ENV

FAMILIES = [pytest.param(f, marks=() if f == "mixtral" else pytest.mark.slow) for f in families.FAMILIES]

MESHES = [("qwen2", {"plan.tp_size": 2}, 2), ("qwen2", {"plan.sp_size": 2}, 2), ("mixtral", {"plan.ep_size": 2}, 2),
          ("mixtral", {"plan.ep_size": 2}, 4)]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_like_plain_torch_on_xla(family, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    families.assert_trains_like_plain_torch("xla", model, tmp_path, env=ENV)


@pytest.mark.slow
@pytest.mark.parametrize("family,plan,devices", MESHES,
                         ids=[f"{f} {' '.join(f'{k[5:]}={v}' for k, v in p.items())} on {d}" for f, p, d in MESHES])
def test_family_trains_like_plain_torch_on_a_mesh(family, plan, devices, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    families.assert_trains_like_plain_torch("xla", model, tmp_path, env=ENV, nproc=devices, plan=plan)
