"""Hugging Face's TPU fsdp_config files, each as a user has it, read with the meaning Trainer gives them
(transformers' training_args._process_fsdp_args and integrations/tpu.wrap_model_xla_fsdp): the plan the command
builds from the file and what its start-up checks say, without a framework. These are decision tests: FSDP v1
over several processes runs on a TPU only (tests/xla/test_hf_tpu_files.py wraps the model from the same files
on PJRT CPU devices, beside Trainer's own wrap)."""
import json
import warnings

import pytest

from portable_fsdp.config.hf_import import apply_fsdp_file, xla_settings_onto_spmd_plan
from portable_fsdp.config.schema import load_recipe
from portable_fsdp.config.validate import check_backend, resolve_plan
from portable_fsdp.plan import WrapPolicy
from tests.conftest import TEST_RECIPE
from tests.unit._helpers import user_error

# The TPU fsdp_config of Hugging Face's guide, verbatim (no xla_fsdp_v2: Trainer's default, false, is FSDP v1).
GUIDE_FILE = {"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "xla": True,
              "xla_fsdp_settings": {"compute_dtype": "bfloat16", "fp32_reduce_scatter": True},
              "xla_fsdp_grad_ckpt": True}
V2_FILE = {"xla": True, "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True,
           "xla_fsdp_settings": {"compute_dtype": "bfloat16", "shard_param_on_dim_0": True, "flatten_parameters": True}}
SIZE_FILE = {"xla": True, "min_num_params": 20000}


def start(tmp_path, fsdp_config: dict | None, backend="xla", device="TPU", nproc=4):
    """The command's steps up to its start-up checks: the recipe, the file, the xla backend's own reading of it,
    the plan, the capability table. Returns (config, plan, [warning messages])."""
    config = load_recipe(TEST_RECIPE)
    config.model.attn_implementation = "eager"  # bf16 under SPMD is autocast, which needs eager attention
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fsdp_config is not None:
            path = tmp_path / "fsdp.json"
            path.write_text(json.dumps(fsdp_config))
            apply_fsdp_file(config, str(path))
        if backend == "xla":
            xla_settings_onto_spmd_plan(config)  # the xla backend's prepare_config
        plan = resolve_plan(config, nproc)
        check_backend(config, plan, backend, device, nproc)
    # the product's own warnings: a library imported on the way may warn too, depending on what ran before
    return config, plan, [str(w.message) for w in caught if w.category.__module__.startswith("portable_fsdp")]


def test_the_guides_file_runs_fsdp_v1_with_its_settings_and_recommends_v2(tmp_path):
    config, plan, said = start(tmp_path, GUIDE_FILE)
    assert plan.xla.xla_fsdp_v2 is False  # as Trainer: xla_fsdp_v2 defaults to false
    assert plan.xla.xla_fsdp_settings == GUIDE_FILE["xla_fsdp_settings"]  # FSDP v1's options, not refused
    assert plan.mixed_precision.param_dtype == "float32"  # v1 reads compute_dtype itself
    assert plan.activation_checkpointing
    (warning,) = said
    assert warning.startswith("plan.xla_fsdp_v2=false: torch_xla's FSDP v1 (one process per device), which a "
                              "Hugging Face fsdp_config with xla: true runs unless it sets xla_fsdp_v2")
    assert warning.endswith('write "xla_fsdp_v2": true in the file, or --config.plan.xla_fsdp_v2=true')


def test_without_a_file_the_xla_backend_keeps_spmd_fsdpv2(tmp_path):
    _, plan, said = start(tmp_path, None)
    assert plan.xla.xla_fsdp_v2 is True and said == []


def test_an_explicit_xla_fsdp_v2_in_the_file_wins(tmp_path):
    assert start(tmp_path, {**GUIDE_FILE, "xla_fsdp_v2": True})[1].xla.xla_fsdp_v2 is True
    assert start(tmp_path, {**GUIDE_FILE, "xla_fsdp_v2": False})[1].xla.xla_fsdp_v2 is False


def test_the_guides_file_on_several_pjrt_cpu_devices_says_what_to_write_instead(tmp_path):
    """Several FSDP v1 processes abort in torch_xla 2.9's CPU collectives: one line, before anything starts."""
    with user_error("--nproc", 'SPMD FSDPv2 for several CPU devices (plan.xla_fsdp_v2=true; in a Hugging Face '
                               'fsdp_config "xla_fsdp_v2": true)'):
        start(tmp_path, GUIDE_FILE, device="CPU", nproc=2)
    assert start(tmp_path, GUIDE_FILE, device="CPU", nproc=1)[1].xla.xla_fsdp_v2 is False  # one device runs


def test_under_v2_the_settings_trainer_ignores_are_one_warning_not_an_error(tmp_path):
    config, plan, said = start(tmp_path, V2_FILE)
    assert plan.mixed_precision.param_dtype == "bfloat16"  # compute_dtype: not silently float32
    assert plan.activation_checkpointing
    (warning,) = said
    assert warning.startswith("plan.xla_fsdp_settings has no effect on --backend xla: {'flatten_parameters': "
                              "True, 'shard_param_on_dim_0': True}: options of torch_xla's FSDP v1")
    assert "ignored as Hugging Face ignores them with xla_fsdp_v2" in warning


def test_min_num_params_with_xla_wraps_by_size_as_trainers_xla_path(tmp_path):
    _, plan, said = start(tmp_path, SIZE_FILE)
    assert (plan.auto_wrap_policy, plan.min_num_params) == (WrapPolicy.SIZE_BASED_WRAP, 20000)
    _, plan, _ = start(tmp_path, {"min_num_params": 20000}, backend="cpu", device="cpu", nproc=2)
    assert plan.auto_wrap_policy == WrapPolicy.TRANSFORMER_BASED_WRAP  # Accelerate's path reads auto_wrap_policy


def test_with_xla_an_auto_wrap_policy_beside_min_num_params_is_not_read_and_says_so(tmp_path):
    _, plan, said = start(tmp_path, {**SIZE_FILE, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    assert plan.auto_wrap_policy == WrapPolicy.SIZE_BASED_WRAP
    assert said[0] == (f"{tmp_path / 'fsdp.json'}: auto_wrap_policy TRANSFORMER_BASED_WRAP is not read with xla: "
                       "true; min_num_params=20000 wraps by size, as Hugging Face's XLA FSDP does")


@pytest.mark.parametrize("backend, device", [("cpu", "cpu"), ("xla", "TPU"), ("flax", "cpu")])
def test_xla_fsdp_grad_ckpt_without_xla_is_one_warning_and_checkpoints_nothing(tmp_path, backend, device):
    _, plan, said = start(tmp_path, {"xla_fsdp_grad_ckpt": True}, backend=backend, device=device)
    assert not plan.activation_checkpointing
    assert said == [f"plan.xla_fsdp_grad_ckpt has no effect on --backend {backend}: Hugging Face reads it only with "
                    "xla: true (torch_xla's FSDP); set plan.activation_checkpointing=true to recompute each layer, or "
                    "plan.xla=true"]


def test_xla_fsdp_grad_ckpt_without_xla_does_not_clash_with_the_models_checkpointing(tmp_path):
    """Read with xla: true only: without it, nothing recomputes twice beside train.gradient_checkpointing."""
    config = load_recipe(TEST_RECIPE)
    config.plan.xla_fsdp_grad_ckpt = True
    config.train.gradient_checkpointing = True
    assert not resolve_plan(config, 2).activation_checkpointing
    config.plan.xla = True
    with user_error("plan.xla_fsdp_grad_ckpt", "set train.gradient_checkpointing=false"):
        resolve_plan(config, 2)
