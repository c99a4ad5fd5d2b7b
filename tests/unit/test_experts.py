"""Which of transformers' expert implementations a MoE model's experts run with, named per device (left to
transformers, it depends on the torch version and the weights' addresses). The CUDA row cannot run here: it is
the decision, with the device type injected; tests/e2e/test_gpu.py runs it on a GPU."""
import pytest
import torch

from portable_fsdp.backends.hf_torch import experts


@pytest.mark.parametrize("device, chosen", [("cuda", "grouped_mm"), ("cpu", "grouped_mm"), ("mps", "eager")])
def test_the_experts_implementation_is_named_per_device(device, chosen):
    assert experts.choose(device) == chosen


def test_a_model_runs_the_implementation_it_is_given():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                               num_experts_per_tok=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    experts.set_implementation(model, "eager")
    assert model.config._experts_implementation == "eager"
    assert experts.experts_per_token(model.config) == 2
    assert experts.routed_expert_params(model) == 4 * 3 * 16 * 32
