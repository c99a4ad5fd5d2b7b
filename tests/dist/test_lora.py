"""LoRA adapters (model.peft) on FSDP2 over 2 gloo ranks: the losses of one process training the same adapters,
gradients and optimizer state on the adapters only, the frozen base's gradients None."""
import json
import os

from tests.dist.launch import torchrun
from tests.parity.reference import max_relative_difference

HERE = os.path.dirname(__file__)
STEPS = 6


def test_lora_on_two_ranks_trains_only_the_adapters_as_one_process_does(tmp_path):
    out = tmp_path / "lora.json"
    torchrun(2, os.path.join(HERE, "lora_check.py"), str(out), str(STEPS))
    result = json.loads(out.read_text())
    assert result["sharded"]
    assert max_relative_difference(result["losses"], result["reference"]) <= 1e-5
    assert result["losses"][-1] < result["losses"][0]
    adapter_names = [n for n in result["parameters"] if ".lora_A." in n or ".lora_B." in n]
    assert len(adapter_names) == 2 * 3 * 2  # A and B of q_proj, v_proj, down_proj in each of the 2 layers
    assert result["with_gradients"] == sorted(adapter_names)  # the frozen base's gradients stay None
    assert result["optimizer_state"] == sorted(adapter_names)
