"""Every model family trains on --backend xla (SPMD FSDPv2 over 2 PJRT CPU devices) from `model.init_from`, with
the losses of a single-process plain-torch run of the same model (tests/parity/families.py). Mixtral is the
case xla needed a fix for (portable_fsdp/backends/xla/moe.py) and runs by default; the other families are slow (Qwen2 runs by
default on cpu and flax).
Slow too: the mesh axes on the families that need them — Qwen2 (q/k/v biases) with tensor and with Ulysses
sequence parallelism, Mixtral with its experts split over ep devices (alone and with fsdp 4 = 2 x ep 2) — and
Mixtral and Qwen3-MoE with the ep devices taken from fsdp × tp (ep = tp on fsdp 1, ep 4 = fsdp 2 × tp 2; Mixtral
on fsdp 1 × tp 2 by default)."""
import pytest

from tests.parity import families
from tests.xla.test_cli import ENV

FAMILIES = [pytest.param(f, marks=() if f == "mixtral" else pytest.mark.slow) for f in families.FAMILIES]

EP_TP2, EP4_TP2 = {"plan.ep_size": 2, "plan.tp_size": 2}, {"plan.ep_size": 4, "plan.tp_size": 2}
MESHES = [("qwen2", {"plan.tp_size": 2}, 2), ("qwen2", {"plan.sp_size": 2}, 2), ("mixtral", {"plan.ep_size": 2}, 2),
          ("mixtral", {"plan.ep_size": 2}, 4), ("mixtral", EP_TP2, 2), ("mixtral", EP4_TP2, 4),
          ("qwen3_moe", EP_TP2, 2), ("qwen3_moe", EP4_TP2, 4)]
FAST_MESHES = [("mixtral", EP_TP2, 2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_like_plain_torch_on_xla(family, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    families.assert_trains_like_plain_torch("xla", model, tmp_path, env=ENV)


@pytest.mark.parametrize("family,plan,devices",
                         [pytest.param(*mesh, marks=() if mesh in FAST_MESHES else pytest.mark.slow)
                          for mesh in MESHES],
                         ids=[f"{f} {' '.join(f'{k[5:]}={v}' for k, v in p.items())} on {d}" for f, p, d in MESHES])
def test_family_trains_like_plain_torch_on_a_mesh(family, plan, devices, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    families.assert_trains_like_plain_torch("xla", model, tmp_path, env=ENV, nproc=devices, plan=plan)
