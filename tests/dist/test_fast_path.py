"""The GPU fast path on CPU: compiled layers (plan.compile) and torchao's float8 layers (plan.float8).

Default suite: which Linear layers become float8 (not the lm_head, only dims divisible by 16), the one-line
start-up errors (torchao missing or built for another torch, a GPU without float8), and — through
`backends.torch.init` on 2 gloo ranks — that every transformer layer (its checkpoint wrapper when checkpointed)
is compiled in place and sharded by FSDP under its own name, and the float8 layers under FSDP train within
float8's rounding of float32 (torchao's CPU emulation computes what a GPU computes), the same with rank-0
loading, and write a FULL checkpoint that from_pretrained reads as a plain model with the trained weights. Slow: 20 compiled steps
against one eager process (1e-5), with activation checkpointing, and at 12 layers (more than dynamo's limit of
8 recompilations); compiled float8 against eager float8; one rank in bf16, as the GPU benchmark runs its rows.
On a GPU: tests/e2e/test_gpu.py."""
import json
import os

import pytest
import torch

from portable_fsdp.machine import gpu_packages
from portable_fsdp.errors import UserError
from tests.dist.launch import torchrun
from tests.parity.matrix import make_config
from tests.parity.reference import max_relative_difference, reference_losses

HERE = os.path.dirname(__file__)
FP32_RTOL = 1e-5
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


def run_check(tmp_path, *variants: str, world: int = 2) -> dict:
    """fast_path_check.py's findings for each VARIANT:STEPS, from one process group of `world` gloo ranks."""
    out = tmp_path / "fast_path.json"
    torchrun(world, os.path.join(HERE, "fast_path_check.py"), str(out), *variants)
    return json.loads(out.read_text())


def tiny_llama(**sizes):
    from portable_fsdp.backends.hf_torch.model import create_model

    overrides = {f"model.{key}": str(value) for key, value in sizes.items()}
    return create_model(make_config(overrides), rank=0, rank0_only=False)


# ---------------------------------------------------------------- float8: which layers, and start-up errors

def test_float8_converts_every_linear_of_the_layers_but_not_the_lm_head():
    from portable_fsdp.backends.torch.float8 import apply_float8

    model = tiny_llama()
    chosen = apply_float8(model)
    expected = [f"model.layers.{i}.{linear}" for i in range(2) for linear in LAYER_LINEARS]
    assert chosen == expected
    assert [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"] == expected
    assert type(model.lm_head) is torch.nn.Linear
    assert "lm_head.weight" in dict(model.named_parameters())  # parameter names unchanged


def test_float8_leaves_layers_whose_dims_do_not_divide_by_16():
    from portable_fsdp.backends.torch.float8 import apply_float8

    # intermediate 72: gate/up (64 -> 72) and down (72 -> 64) stay; attention (64 -> 64 / 32) converts
    chosen = apply_float8(tiny_llama(intermediate_size=72, num_hidden_layers=1))
    assert chosen == [f"model.layers.0.{linear}" for linear in LAYER_LINEARS[:4]]


def test_float8_leaves_a_tied_lm_head():
    from portable_fsdp.backends.torch.float8 import apply_float8

    model = tiny_llama(tie_word_embeddings="true", num_hidden_layers=1)
    assert "lm_head" not in apply_float8(model) and type(model.lm_head) is torch.nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_float8_without_torchao_is_one_line_naming_the_install(monkeypatch):
    from portable_fsdp.backends.torch import float8

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name=name.split(".")[0])

    monkeypatch.setattr(float8.importlib, "import_module", missing)
    with pytest.raises(UserError) as caught:
        float8.check_supported(torch.device("cpu"), 256)
    release = gpu_packages.torchao_for(torch.__version__)  # the one built for this torch (0.14.1 for 2.9)
    assert caught.value.line() == ("error: plan.float8: needs torchao, which is not installed: pip install "
                                   f"'torchao=={release}'")


def test_float8_with_a_torchao_built_for_another_torch_names_the_pin(monkeypatch):
    from portable_fsdp.backends.torch import float8

    def mismatched(name):
        raise ImportError("cannot import name 'xyz' from 'torch._C'\nmore detail")

    monkeypatch.setattr(float8.importlib, "import_module", mismatched)
    with pytest.raises(UserError) as caught:
        float8.check_supported(torch.device("cpu"), 256)
    line = caught.value.line()
    assert "\n" not in line and f"does not import with torch {torch.__version__}" in line
    assert line.endswith(f"pip install 'torchao=={gpu_packages.torchao_for(torch.__version__)}'")


def test_float8_needs_tokens_per_rank_its_products_take():
    """The weight gradient's product runs over the micro-batch's tokens: torch._scaled_mm takes multiples of 16."""
    from portable_fsdp.backends.torch import float8

    float8.check_supported(torch.device("cpu"), 4 * 64)
    with pytest.raises(UserError, match="each rank's micro-batch holds 200 tokens, and float8 products need a "
                                        "multiple of 16"):
        float8.check_supported(torch.device("cpu"), 200)


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_float8_on_a_gpu_without_float8_tensor_cores_is_refused_at_start_up(monkeypatch, capability, refused):
    from portable_fsdp.backends.torch import float8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    if not refused:
        float8.check_supported(torch.device("cuda", 0), 256)
        return
    with pytest.raises(UserError) as caught:
        float8.check_supported(torch.device("cuda", 0), 256)
    assert caught.value.line() == (
        "error: plan.float8: needs float8 tensor cores (compute capability 8.9 or newer: L4, H100, H200, B200); "
        f"NVIDIA A100-SXM4-80GB has {capability[0]}.{capability[1]}: set plan.float8=false")


# ---------------------------------------------------------------- through the backend, on 2 gloo ranks

def test_layers_are_compiled_in_place_and_float8_trains_under_fsdp(tmp_path):
    results = run_check(tmp_path, "eager:3", "float8:3", "float8_rank0_loading:3", "compile_checkpointing:0")
    layers = ["model.layers.0", "model.layers.1"]
    eager, float8, compiled = results["eager"], results["float8"], results["compile_checkpointing"]
    # compiled in place: each layer's checkpoint wrapper, which is the FSDP unit (fully_shard prefixes its class)
    assert eager["compiled"] == [] and compiled["compiled"] == layers
    assert compiled["compiled_classes"] == ["FSDPCheckpointWrapper"] and compiled["fsdp_units"] == ["", *layers]
    assert compiled["parameter_names"] == eager["parameter_names"] == [n for n, _ in tiny_llama().named_parameters()]
    # float8: every Linear of the layers, under FSDP, the parameters and their names unchanged
    assert eager["float8"] == []
    assert float8["float8"] == [f"{layer}.{linear}" for layer in layers for linear in LAYER_LINEARS]
    assert float8["fsdp_units"] == ["", *layers] and float8["parameter_names"] == eager["parameter_names"]
    # float8 rounds every product (e4m3: 3 mantissa bits): close to float32, and not equal to it
    difference = max_relative_difference(float8["losses"], eager["losses"])
    assert 1e-6 < difference < 5e-3, (float8["losses"], eager["losses"])
    # swapped on the meta device of rank 1 and filled from rank 0: the same run
    assert results["float8_rank0_loading"]["losses"] == float8["losses"]
    # a FULL checkpoint of float8 layers is a plain transformers model's, as from_pretrained reads it
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "float8")
    assert [n for n, _ in loaded.named_parameters()] == eager["parameter_names"]
    weights = dict(loaded.named_parameters())
    for name, total in float8["weight_sums"].items():  # the trained weights, not the initial ones
        assert weights[name].double().sum().item() == pytest.approx(total, rel=1e-6), name


@pytest.mark.slow
def test_compiled_layers_train_like_one_eager_process(tmp_path):
    steps = 20
    results = run_check(tmp_path, *(f"{name}:{steps}" for name in ("compile", "compile_checkpointing",
                                                                    "compile_12_layers")))
    assert results["compile"]["compiled"] == ["model.layers.0", "model.layers.1"]
    assert results["compile"]["compiled_classes"] == ["FSDPLlamaDecoderLayer"]
    reference = reference_losses(make_config({}), steps)
    for name in ("compile", "compile_checkpointing"):
        assert max_relative_difference(results[name]["losses"], reference) <= FP32_RTOL, name
    assert len(results["compile_12_layers"]["compiled"]) == 12
    reference_12 = reference_losses(make_config({"model.num_hidden_layers": "12"}), steps)
    assert max_relative_difference(results["compile_12_layers"]["losses"], reference_12) <= FP32_RTOL


@pytest.mark.slow
def test_compiled_float8_layers_train_like_eager_float8(tmp_path):
    results = run_check(tmp_path, "float8:5", "compile_float8:5")
    assert results["compile_float8"]["float8"] == results["float8"]["float8"]
    assert len(results["compile_float8"]["compiled"]) == 2
    # inductor fuses the casts and the scale computations: float8's rounding may land differently
    assert max_relative_difference(results["compile_float8"]["losses"], results["float8"]["losses"]) < 1e-3


@pytest.mark.slow
def test_one_rank_trains_the_benchmarks_bf16_settings(tmp_path):
    """One rank, as benchmarks/gpu.py runs each row (the plain module under bf16 autocast): compiled layers and
    float8 layers against the eager bf16 run."""
    results = run_check(tmp_path, "bf16:5", "compile_bf16:5", "float8_bf16:5", world=1)
    bf16 = results["bf16"]["losses"]
    assert results["compile_bf16"]["compiled"] == ["model.layers.0", "model.layers.1"]
    assert max_relative_difference(results["compile_bf16"]["losses"], bf16) <= 2.0**-8  # one bf16 rounding
    assert len(results["float8_bf16"]["float8"]) == 2 * len(LAYER_LINEARS)
    assert 0 < max_relative_difference(results["float8_bf16"]["losses"], bf16) < 5e-3
