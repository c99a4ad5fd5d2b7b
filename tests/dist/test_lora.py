"""LoRA adapters (model.peft) on FSDP2 over 2 gloo ranks, the model built on the meta device or on rank 0 alone:
the losses of one process training the same adapters, gradients and optimizer state on the adapters only, the
frozen base's gradients None."""
import json
import os

import pytest

from tests.dist.launch import torchrun
from tests.parity.reference import max_relative_difference

HERE = os.path.dirname(__file__)
STEPS = 6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "lora.json"
    torchrun(2, os.path.join(HERE, "lora_check.py"), str(out), str(STEPS), "meta", "rank0")
    return json.loads(out.read_text())


# meta: every rank builds the model on the meta device; rank0: plan.cpu_ram_efficient_loading
@pytest.mark.parametrize("case", ["meta", "rank0"])
def test_lora_on_two_ranks_trains_only_the_adapters_as_one_process_does(results, case):
    result = results[case]
    assert result["sharded"]
    assert max_relative_difference(result["losses"], result["reference"]) <= 1e-5
    assert result["losses"][-1] < result["losses"][0]
    adapter_names = [n for n in result["parameters"] if ".lora_A." in n or ".lora_B." in n]
    assert len(adapter_names) == 2 * 3 * 2  # A and B of q_proj, v_proj, down_proj in each of the 2 layers
    assert result["with_gradients"] == sorted(adapter_names)  # the frozen base's gradients stay None
    assert result["optimizer_state"] == sorted(adapter_names)
