"""Every xla-specific start-up error: exit status 2 and one stderr line `error: <field>: ...` naming the fix,
raised before anything compiles. Plus the checkpoint refusals, which come at resume time."""
import json

import pytest

from tests.conftest import TEST_RECIPE
from tests.xla.helpers import run_script

V1 = ["--config.plan.xla_fsdp_v2=false", "--nproc", "1"]


def settings(value: str) -> str:
    return f"--config.plan.xla_fsdp_settings={value}"


CASES = [
    # (arguments, field named, a phrase of the fix)
    (["--config.plan.cpu_offload=true"], "plan.cpu_offload", "set plan.cpu_offload=false"),
    (["--config.plan.cp_size=2", "--config.plan.cp_impl=torch"], "plan.cp_impl", "needs CUDA SDPA kernels"),
    (["--config.plan.reshard_after_forward=false"], "plan.reshard_after_forward", "plan.xla_fsdp_v2=false"),
    (["--config.plan.param_dtype=float16"], "plan.param_dtype", "use bfloat16"),
    (["--config.plan.param_dtype=bfloat16", "--config.plan.reduce_dtype=bfloat16"], "plan.reduce_dtype",
     "set plan.reduce_dtype=float32"),
    (["--config.plan.param_dtype=bfloat16"], "plan.param_dtype", "model.attn_implementation=eager"),
    (["--config.plan.xla=true", "--config.plan.xla_fsdp_grad_ckpt=true", "--config.train.gradient_checkpointing=true"],
     "plan.xla_fsdp_grad_ckpt", "train.gradient_checkpointing=false"),
    # compute_dtype is plan.param_dtype under SPMD FSDPv2: bf16 then needs eager attention
    ([settings('{"compute_dtype": "bfloat16"}')], "plan.param_dtype", "model.attn_implementation=eager"),
    (["--config.plan.xla_fsdp_v2=false"], "--nproc", "use --nproc 1 on the CPU"),
    ([*V1, "--config.plan.cpu_ram_efficient_loading=true"], "plan.cpu_ram_efficient_loading",
     "plan.xla_fsdp_v2=true"),
    ([*V1, "--config.plan.reduce_dtype=bfloat16"], "plan.reduce_dtype", "fp32_reduce_scatter"),
    ([*V1, settings('{"flatten_param": true}')], "plan.xla_fsdp_settings",
     "unknown key 'flatten_param'; torch_xla's XlaFullyShardedDataParallel accepts: "),
    ([*V1, settings('{"auto_wrap_policy": "always"}')], "plan.xla_fsdp_settings", "set by plan.auto_wrap_policy"),
    ([*V1, settings('{"sharding_groups": [[0]]}')], "plan.xla_fsdp_settings", "the plan's mesh"),
    ([*V1, settings('{"compute_dtype": "fp8"}')], "plan.xla_fsdp_settings", "unknown dtype 'fp8'"),
    ([*V1, settings('{"flatten_parameters": "yes"}')], "plan.xla_fsdp_settings", "must be true or false"),
    ([*V1, settings('{"flatten_parameters": true}')], "plan.xla_fsdp_settings", "train.weight_decay=0"),
    ([*V1, "--config.plan.reshard_after_forward=false", settings('{"reshard_after_forward": true}')],
     "plan.xla_fsdp_settings", "contradicts plan.reshard_after_forward=false"),
    ([*V1, "--config.plan.param_dtype=bfloat16", settings('{"compute_dtype": "float16"}')],
     "plan.xla_fsdp_settings", "contradicts plan.param_dtype=bfloat16"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    (tmp / "cases.json").write_text(json.dumps([["--config", TEST_RECIPE, *args] for args, _, _ in CASES]))
    run_script("error_cases.py", [tmp / "out.json", tmp / "cases.json"])
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(c[0]) for c in CASES])
def test_xla_start_up_error_is_one_line_naming_the_field(outcomes, index):
    _, field, fix = CASES[index]
    outcome = outcomes[index]
    assert outcome["code"] == 2, outcome
    errors = [line for line in outcome["stderr"] if line.startswith("error:")]
    assert len(errors) == 1 and len(outcome["stderr"]) <= 3, outcome["stderr"]  # + torch_xla's device notice
    assert errors[0].startswith(f"error: {field}: "), errors[0]
    assert fix in errors[0], errors[0]
