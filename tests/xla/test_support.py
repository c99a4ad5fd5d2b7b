"""The start-up rules that a CPU command line cannot reach (FSDP v1 runs one CPU device, so never with a cp
axis or on another PJRT device), checked directly: backends/xla/support.py imports no framework."""
import dataclasses

import pytest

from portable_fsdp.errors import UserError
from portable_fsdp.plan import MeshSpec
from portable_fsdp.validate import resolve_plan
from tests.dist.fsdp_variants import make_config


def plan_for(world: int, **overrides):
    config = make_config({k: str(v).lower() for k, v in overrides.items()})
    return config, resolve_plan(config, world)


def check(config, plan, device="TPU", nproc=4):
    from portable_fsdp.backends.xla import support

    support.check_plan(plan, config, device, nproc)


def test_v1_has_no_sequence_sharding():
    config, plan = plan_for(4, **{"plan.xla_fsdp_v2": False})
    plan = dataclasses.replace(plan, mesh=MeshSpec(fsdp_size=2, cp_size=2))
    with pytest.raises(UserError, match="cannot split sequences") as err:
        check(config, plan)
    assert err.value.field == "plan.cp_size"


def test_v1_is_launched_on_cpu_and_tpu_only():
    config, plan = plan_for(4, **{"plan.xla_fsdp_v2": False})
    with pytest.raises(UserError, match="CPU and TPU only") as err:
        check(config, plan, device="CUDA")
    assert err.value.field == "plan.xla_fsdp_v2"


def test_spmd_and_v1_defaults_pass_on_tpu():
    check(*plan_for(4))
    check(*plan_for(4, **{"plan.xla_fsdp_v2": False}))


def test_torch_only_settings_are_named_as_ignored():
    from portable_fsdp.backends.xla import support

    _, plan = plan_for(2, **{"plan.cp_size": 2, "plan.cp_rotate_method": "alltoall", "plan.cp_load_balance": False})
    assert support.ignored_torch_settings(plan) == ["plan.cp_rotate_method", "plan.cp_load_balance"]
    _, plan = plan_for(2, **{"plan.cp_size": 2})
    assert support.ignored_torch_settings(plan) == []
    _, plan = plan_for(2, **{"plan.cpu_collectives": "gloo"})
    assert support.ignored_torch_settings(plan) == ["plan.cpu_collectives"]
