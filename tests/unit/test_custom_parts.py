"""A user's parts on the torch-based lowerings, in one process: what start-up reads of a custom module, its meta
init, and the one-line errors for parts these backends cannot take."""
import pytest
import torch
from torch import nn

from examples.custom_model.torch_mlp import MLPLanguageModel, token_mean_loss
from portable_fsdp.backends.hf_torch import custom_model
from portable_fsdp.backends.hf_torch.loss import Objective
from portable_fsdp.backends.hf_torch.optimizer import build_optimizer
from portable_fsdp.errors import UserError
from tests.parity.matrix import make_config
from portable_fsdp.config.validate import resolve_plan


def test_describe_reads_the_module():
    with torch.device("meta"):
        model = MLPLanguageModel(vocab_size=384, hidden_size=64, num_layers=3)
    info = custom_model.describe(model)
    assert (info.n_layers, info.vocab_size, info.hidden_size, info.root_class) == (3, 384, 64, "MLPLanguageModel")
    assert info.no_split_modules == ("MLPBlock",) and info.tp_plan == MLPLanguageModel._tp_plan
    assert info.n_params == sum(p.numel() for p in model.parameters())
    assert info.n_embedding_params == 384 * 64  # the lookup table, not in MFU's 6·N
    assert info.model_type == ""


def test_meta_init_replays_the_modules_own_init():
    """What each rank fills its shards with: `torch.manual_seed(seed); init_weights()`, bit for bit."""
    with torch.device("meta"):
        model = MLPLanguageModel(vocab_size=384)
    filled = {}
    custom_model.on_meta(model, seed=7).fill(lambda names, full: filled.update({n: full for n in names}))
    built = MLPLanguageModel(vocab_size=384)
    torch.manual_seed(7)
    built.init_weights()
    assert filled.keys() == dict(built.named_parameters()).keys()
    assert all(torch.equal(filled[n], p) for n, p in built.named_parameters())


def test_a_built_module_is_trained_as_given():
    assert custom_model.on_meta(MLPLanguageModel(vocab_size=384), seed=7) is None


def test_without_init_weights_each_reset_parameters_runs():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    filled = {}
    custom_model.on_meta(model, seed=3).fill(lambda names, full: filled.update({n: full for n in names}))
    built = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    torch.manual_seed(3)
    for module in built.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert all(torch.equal(filled[n], p) for n, p in built.named_parameters())


class HalfInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.extra = nn.Parameter(torch.empty(3))

    def init_weights(self):
        nn.init.normal_(self.embed.weight)


def test_a_meta_module_whose_init_leaves_a_parameter_unwritten_is_one_line():
    with torch.device("meta"):
        model = HalfInit()
    with pytest.raises(UserError, match=r"^model: HalfInit on the meta device cannot be initialised .*extra"):
        custom_model.on_meta(model, seed=0)


def test_a_buffer_on_the_meta_device_is_one_line():
    with torch.device("meta"):
        model = nn.BatchNorm1d(4)
    with pytest.raises(UserError, match=r"^model: BatchNorm1d's buffer running_mean is on the meta device"):
        custom_model.on_meta(model, seed=0)


def test_a_model_that_is_not_a_torch_module_is_one_line():
    class NnxModel:
        pass

    with pytest.raises(UserError, match=r"^model: is a .*NnxModel; the cpu, cuda and xla backends train a "
                                        r"torch.nn.Module"):
        custom_model.describe(NnxModel())


def test_a_module_without_a_vocabulary_is_one_line():
    with pytest.raises(UserError, match=r"^model: Linear has no nn.Embedding and no vocab_size"):
        custom_model.describe(nn.Linear(4, 4))


@pytest.mark.parametrize("field", ["plan.cp_size", "plan.sp_size"])
def test_a_sequence_split_of_a_custom_module_is_one_line(field):
    plan = resolve_plan(make_config({field: "2"}), 2)
    with pytest.raises(UserError, match=rf"^{field}: is 2, but a model passed in runs its own attention"):
        custom_model.check_run(MLPLanguageModel(), make_config({}), plan)


def test_a_loss_that_returns_no_pair_is_one_line():
    model = MLPLanguageModel(vocab_size=16)
    ids = torch.zeros(1, 4, dtype=torch.long)
    objective = Objective(custom_model.Forward.of(model), lambda outputs, batch: outputs.sum())
    with pytest.raises(UserError, match=r"^loss: returned Tensor; a loss returns \(sum, count\)"):
        objective(model, ids, ids, None)


def test_a_loss_may_count_with_a_number():
    model = MLPLanguageModel(vocab_size=16)
    ids = torch.zeros(1, 4, dtype=torch.long)
    total, count = Objective(custom_model.Forward.of(model), lambda o, b: (o.sum(), 4))(model, ids, ids, None)
    assert count.item() == 4.0 and total.requires_grad
    total, count = Objective(custom_model.Forward.of(model), token_mean_loss)(model, ids, ids, None)
    assert count.item() == 4


def test_an_optimizer_factory_that_returns_no_optimizer_is_one_line():
    params = [(nn.Parameter(torch.zeros(2)), 1)]
    with pytest.raises(UserError, match=r"^optimizer: returned list; pass a function of the parameters"):
        build_optimizer(params, make_config({}).train, "cpu", factory=lambda ps: list(ps))


def test_the_optimizer_factory_gets_the_trainable_parameters():
    trained, frozen = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2), requires_grad=False)
    optimizer = build_optimizer([(trained, 1), (frozen, 1)], make_config({}).train, "cpu",
                                factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert optimizer.param_groups[0]["params"] == [trained]


def test_transformers_gradient_checkpointing_of_a_custom_module_is_one_line():
    from portable_fsdp.backends.torch import step

    config = make_config({"train.gradient_checkpointing": "true"})
    with pytest.raises(UserError, match=r"^train.gradient_checkpointing: is transformers' own checkpointing; for a "
                                        r"model passed in set plan.activation_checkpointing=true"):
        step.init(config, resolve_plan(config, 1), "cpu", step.Parts(model=MLPLanguageModel(vocab_size=384)))


def test_adapters_of_the_config_on_a_custom_module_are_one_line():
    from portable_fsdp.backends.torch import step

    config = make_config({"model.peft.type": "lora"})
    with pytest.raises(UserError, match=r"^model.peft: adds adapters to the config's model; to a model passed in add "
                                        r"them yourself \(peft.inject_adapter_in_model\)"):
        step.init(config, resolve_plan(config, 1), "cpu", step.Parts(model=MLPLanguageModel(vocab_size=384)))


def test_parts_cannot_cross_into_started_workers(tmp_path):
    from portable_fsdp.backends.torch.launch import start_workers
    from portable_fsdp.config.accelerate import LaunchSettings
    from portable_fsdp.training.parts import Parts

    spec = {"backend": "cpu", "parts": Parts(model=MLPLanguageModel(), loss=token_mean_loss)}
    with pytest.raises(UserError, match=r"^model, loss: live in this process, where started workers cannot call them: "
                                        r"use nproc=1 \(got 2\), or call train under torchrun"):
        start_workers(make_config({}), spec, tmp_path, 2, LaunchSettings(), lambda *args, **kwargs: None)


def test_a_resume_into_a_module_of_other_shapes_is_one_line(tmp_path):
    from safetensors.torch import save_file

    from portable_fsdp.backends.torch.checkpoint import load_full_weights

    save_file({n: p.detach().contiguous() for n, p in MLPLanguageModel(vocab_size=384, hidden_size=32).named_parameters()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"^train.resume: the weights in .* hold embed.weight of shape \(384, 32\), "
                                        r"the model's is \(384, 64\): another model"):
        load_full_weights(MLPLanguageModel(vocab_size=384, hidden_size=64), tmp_path)
