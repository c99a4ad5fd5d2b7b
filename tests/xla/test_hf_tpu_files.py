"""Hugging Face TPU fsdp_config files, each as a user has it, wrap the model as Trainer wraps it: the command's
start-up (tests/xla/hf_wrap_check.py) beside transformers' own wrap_model_xla_fsdp on the same model, on PJRT CPU
devices. FSDP v1 runs one process per device, which PJRT CPU collectives cannot (torch_xla 2.9): its case is
the decision on one device — the units, the checkpointed layers and XlaFullyShardedDataParallel's keyword
arguments — and the multi-process run is the TPU's (tests/xla/test_tpu.py)."""
import json

from tests.unit.test_hf_tpu_files import GUIDE_FILE, SIZE_FILE
from tests.xla.helpers import run_script


def wrapped(tmp_path, fsdp_config: dict, devices: int) -> dict:
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(fsdp_config))
    run_script("hf_wrap_check.py", [tmp_path / "out.json", path, devices])
    return json.loads((tmp_path / "out.json").read_text())


def test_the_guides_file_is_fsdp_v1_with_trainers_units_checkpointing_and_options(tmp_path):
    """Decision test (one PJRT CPU device): the multi-process FSDP v1 run needs a TPU."""
    found = wrapped(tmp_path, GUIDE_FILE, 1)
    ours, trainer = found["ours"], found["hugging_face"]
    assert ours["v2"] is trainer["v2"] is False
    assert ours["units"] == trainer["units"] == ["", "model.layers.0", "model.layers.1"]
    assert ours["checkpointed"] == trainer["checkpointed"] == ["model.layers.0", "model.layers.1"]
    assert trainer["kwargs"] == {"compute_dtype": "torch.bfloat16", "fp32_reduce_scatter": True}
    assert {key: ours["kwargs"][key] for key in trainer["kwargs"]} == trainer["kwargs"]


def test_min_num_params_wraps_by_size_on_spmd_fsdpv2_as_trainer(tmp_path):
    found = wrapped(tmp_path, {**SIZE_FILE, "xla_fsdp_v2": True}, 2)
    ours, trainer = found["ours"], found["hugging_face"]
    assert ours["v2"] is trainer["v2"] is True
    assert ours["units"] == trainer["units"]
    assert "model.layers.0.mlp" in ours["units"] and "model.layers.0" not in ours["units"]  # by size, not by layer
