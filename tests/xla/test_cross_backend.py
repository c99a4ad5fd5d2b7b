"""Checkpoints move between backends: a FULL checkpoint the torch backend writes loads on xla (weights and
AdamW state: training continues as if uninterrupted), and one xla writes — every shard gathered — loads on
the torch backend and in plain transformers. eval_loss through the shared eval layer agrees throughout."""
import json

import pytest

from tests.parity.matrix import make_config
from tests.parity.reference import max_relative_difference, reference_losses
from tests.xla.helpers import run_script

EVAL_ATOL = 1e-6
FP32_RTOL = 1e-5


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """cpu: train 3 steps, save T -> xla: load T, train steps 3-5, save X -> cpu: load X."""
    tmp = tmp_path_factory.mktemp("cross")
    torch_ckpt, xla_ckpt = tmp / "from_cpu", tmp / "from_xla"
    run_script("cross_backend.py", ["cpu", tmp / "a.json", "--train", 0, 3, "--save", torch_ckpt])
    run_script("cross_backend.py", ["xla", tmp / "b.json", "--load", torch_ckpt, 3, "--train", 3, 6,
                                    "--save", xla_ckpt])
    run_script("cross_backend.py", ["cpu", tmp / "c.json", "--load", xla_ckpt, 6])
    results = [json.loads((tmp / f"{x}.json").read_text()) for x in "abc"]
    return (*results, xla_ckpt)


def test_eval_layer_gives_the_same_eval_loss_on_both_backends(chain):
    on_cpu, on_xla, _, _ = chain
    assert on_xla["initial_eval"] == pytest.approx(on_cpu["initial_eval"], abs=EVAL_ATOL)


def test_cpu_checkpoint_loads_on_xla(chain):
    on_cpu, on_xla, _, _ = chain
    assert on_xla["loaded_eval"] == pytest.approx(on_cpu["saved_eval"], abs=EVAL_ATOL)
    assert on_xla["loaded_eval"] != pytest.approx(on_xla["initial_eval"], abs=1e-3)  # the load matters


def test_training_continues_from_the_cpu_optimizer_state(chain):
    _, on_xla, _, _ = chain
    assert max_relative_difference(on_xla["losses"], reference_losses(make_config({}), 6)[3:]) <= FP32_RTOL


def test_xla_checkpoint_loads_on_cpu(chain):
    _, on_xla, back_on_cpu, _ = chain
    assert back_on_cpu["loaded_eval"] == pytest.approx(on_xla["saved_eval"], abs=EVAL_ATOL)


def test_xla_checkpoint_is_a_transformers_directory_of_trained_weights(chain):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from portable_fsdp.backends.hf_torch.model import create_model

    _, _, _, xla_ckpt = chain
    model = AutoModelForCausalLM.from_pretrained(xla_ckpt, local_files_only=True)
    initial = create_model(make_config({}), rank=0, rank0_only=False).state_dict()
    saved = load_file(xla_ckpt / "model.safetensors")
    assert set(saved) == set(initial)  # every tensor, under the transformers names
    assert all(saved[k].shape == initial[k].shape for k in saved)  # full shapes: every shard gathered
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.state_dict()["lm_head.weight"], saved["lm_head.weight"])
