"""A flax.nnx model of the user's own on --backend flax (`pf.init(..., model=module)`): it computes what its torch
twin computes, it is described for the start-up checks and MFU, and sharded over fsdp or tp (its `_tp_plan`), or
replicated over dp, it trains as on one device."""
import numpy as np
import pytest

from tests.flax.conftest import flax_losses, init_state, make_config, needs_devices
from tests.flax.test_parity import FP32_RTOL
from tests.parity.reference import max_relative_difference

STEPS = 5


def mlp(vocab_size: int, seed: int = 0, tp_plan: dict | None = None):
    """nnx_mlp's model; with `tp_plan`, a subclass whose `_tp_plan` it is."""
    from flax import nnx

    from examples.custom_model.nnx_mlp import MLPLanguageModel

    if tp_plan is None:
        return MLPLanguageModel(vocab_size=vocab_size, rngs=nnx.Rngs(seed))
    split = type("SplitMLPLanguageModel", (MLPLanguageModel,), {"_tp_plan": tp_plan})
    return split(vocab_size=vocab_size, rngs=nnx.Rngs(seed))


MLP_TP_PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


def torch_twin(vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2):
    """The torch module nnx_mlp.py mirrors: Embedding -> (LayerNorm, Linear, tanh GELU, Linear, residual) blocks ->
    LayerNorm -> Linear without bias."""
    import torch
    import torch.nn.functional as F

    class MLPBlock(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.up, self.down = torch.nn.LayerNorm(d, eps=1e-5), torch.nn.Linear(d, 4 * d), \
                torch.nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x)), approximate="tanh"))

    class MLPLanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab_size, hidden_size)
            self.layers = torch.nn.ModuleList([MLPBlock(hidden_size) for _ in range(num_layers)])
            self.norm = torch.nn.LayerNorm(hidden_size, eps=1e-5)
            self.head = torch.nn.Linear(hidden_size, vocab_size, bias=False)

        def forward(self, input_ids, position_ids=None):
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return MLPLanguageModel()


def test_the_nnx_mlp_computes_what_its_torch_twin_computes():
    import torch

    from examples.custom_model.nnx_mlp import load_torch_state_dict

    twin, model = torch_twin(), mlp(256, seed=1)
    with torch.no_grad():
        for p in twin.parameters():  # LayerNorms away from their 1/0 init: a swapped scale and bias would show
            p.add_(0.1 * torch.randn_like(p))
    load_torch_state_dict(model, {k: v.numpy() for k, v in twin.state_dict().items()})
    ids = np.random.default_rng(0).integers(0, 256, size=(2, 16))
    with torch.no_grad():
        expected = twin(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=1e-5, rtol=1e-5)


def test_the_module_is_described_for_the_start_up_checks():
    import portable_fsdp as pf
    from portable_fsdp.backends.flax import describe_model
    from portable_fsdp.training.parts import Parts

    config = make_config()
    model = mlp(config.model.vocab_size)
    info = describe_model(config, Parts(model=model))
    d, v = 64, config.model.vocab_size
    block = 2 * d + d * 4 * d + 4 * d + 4 * d * d + d
    assert (info.n_params, info.n_embedding_params) == (v * d + 2 * block + 2 * d + d * v, v * d)
    assert (info.n_layers, info.hidden_size, info.vocab_size) == (2, d, v)
    assert (info.root_class, info.no_split_modules, info.model_type) == ("MLPLanguageModel", ("MLPBlock",), "")
    assert "MLPBlock" in info.class_names and info.inner_classes["MLPBlock"] == ("LayerNorm", "Linear")
    # what the command checks before it starts: a model of no transformers family passes the capability table
    assert pf.plan_for(config, 1, backend="flax", model=model).mesh.fsdp_size == 1


@needs_devices(2)
@pytest.mark.parametrize("overrides", [
    {"plan.fsdp_size": 2},
    pytest.param({"plan.dp_replicate_size": -1, "plan.fsdp_size": 1}, marks=pytest.mark.slow),
    pytest.param({"plan.dp_replicate_size": 2, "plan.fsdp_size": 2, "train.batch_size": 8},
                 marks=[pytest.mark.slow, needs_devices(4)]),
    pytest.param({"plan.cp_size": 2}, marks=pytest.mark.slow),
    {"plan.tp_size": 2, "plan.fsdp_size": 1},
])
def test_sharded_over_the_mesh_it_trains_as_on_one_device(overrides):
    from portable_fsdp import placement
    from portable_fsdp.training.parts import Parts

    config = make_config({"train.grad_accum_steps": 2, **overrides})
    world = 4 if overrides.get("plan.dp_replicate_size") == 2 else 2
    same_batches = make_config({"train.grad_accum_steps": 2, **{k: v for k, v in overrides.items()
                                                                if not k.startswith("plan.")}})
    tp_plan = MLP_TP_PLAN if "plan.tp_size" in overrides else None
    one = flax_losses(same_batches, 1, STEPS, Parts(model=mlp(config.model.vocab_size, tp_plan=tp_plan)))
    many = flax_losses(config, world, STEPS, Parts(model=mlp(config.model.vocab_size, tp_plan=tp_plan)))
    assert max_relative_difference(many, one) <= FP32_RTOL

    state = init_state(config, world, Parts(model=mlp(config.model.vocab_size, tp_plan=tp_plan)))
    spec = state.ctx.param_sharding["layers.0.up.kernel"].spec  # [64, 256]: split on its larger dimension
    shard_axes = [a for a in placement.SHARD_AXES if state.ctx.mesh.shape[a] > 1]
    if tp_plan:  # colwise: the output features over tp
        assert tuple(spec) == (None, "tp") and tuple(state.ctx.param_sharding["layers.0.down.kernel"].spec) == \
            ("tp", None)
    else:
        assert tuple(spec) == ((None, shard_axes[0]) if shard_axes else (None, None))


def test_a_torch_module_or_another_object_is_refused_in_one_line():
    from portable_fsdp.errors import UserError
    from portable_fsdp.training.parts import Parts

    config = make_config()
    with pytest.raises(UserError, match="torch.nn.Module.*pass its flax.nnx counterpart") as err:
        init_state(config, 1, Parts(model=torch_twin()))
    assert err.value.field == "model" and "\n" not in str(err.value)
    with pytest.raises(UserError, match="is not a flax.nnx.Module"):
        init_state(config, 1, Parts(model=object()))


def test_what_a_user_module_cannot_do_here_is_refused_by_field():
    from flax import nnx

    from portable_fsdp.backends.flax import describe_model
    from portable_fsdp.errors import UserError
    from portable_fsdp.training.parts import Parts

    model = mlp(make_config().model.vocab_size)
    cases = [({"plan.tp_size": 2, "plan.fsdp_size": 1}, "plan.tp_plan"),  # no _tp_plan: nothing to split
             ({"plan.activation_checkpointing": True}, "plan.activation_checkpointing")]
    for overrides, field in cases:
        with pytest.raises(UserError) as err:
            init_state(make_config(overrides), 2, Parts(model=model))
        assert err.value.field == field and "\n" not in str(err.value)

    class NoVocabulary(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    with pytest.raises(UserError, match="vocab_size attribute"):
        describe_model(make_config(), Parts(model=NoVocabulary()))


def test_a_checkpoint_of_another_module_is_refused_on_resume(tmp_path):
    from flax import nnx

    from examples.custom_model.nnx_mlp import MLPLanguageModel
    from portable_fsdp.backends.flax import checkpoint
    from portable_fsdp.errors import UserError
    from portable_fsdp.training.parts import Parts

    config = make_config()
    vocab = config.model.vocab_size
    checkpoint.save_checkpoint(init_state(config, 1, Parts(model=mlp(vocab))), tmp_path)
    for other in (MLPLanguageModel(vocab, num_layers=3, rngs=nnx.Rngs(0)),  # a layer the checkpoint lacks
                  MLPLanguageModel(vocab, hidden_size=32, rngs=nnx.Rngs(0))):  # every weight of another shape
        with pytest.raises(UserError, match="holds no weights of this model's shape") as err:
            checkpoint.load_checkpoint(init_state(config, 1, Parts(model=other)), tmp_path, {"step": 0})
        assert err.value.field == "train.resume" and "\n" not in str(err.value)
