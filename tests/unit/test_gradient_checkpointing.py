"""train.gradient_checkpointing is transformers' own checkpointing of every layer; a lowering may give it the
checkpoint function to use (torch_xla's, behind XLA's optimization barrier)."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from portable_fsdp.backends.hf_torch.model import enable_gradient_checkpointing


def tiny():
    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_every_layer_checkpoints_through_the_function_given():
    def barrier_checkpoint(function, *args):
        return function(*args)

    model = tiny()
    enable_gradient_checkpointing(model, barrier_checkpoint)
    layers = model.model.layers
    assert all(layer.gradient_checkpointing and layer._gradient_checkpointing_func is barrier_checkpoint
               for layer in layers)


def test_by_default_torchs_non_reentrant_checkpoint():
    model = tiny()
    enable_gradient_checkpointing(model)
    func = model.model.layers[0]._gradient_checkpointing_func
    assert model.model.layers[0].gradient_checkpointing
    assert func.keywords == {"use_reentrant": False}
