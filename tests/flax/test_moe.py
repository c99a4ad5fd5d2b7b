"""The routed MoE kernel (portable_fsdp/backends/flax/moe.py) computes what every expert on every token, combined by
the router's weights, computes — outputs and gradients, with uneven and empty experts, top-1 and top-2 —, on one
device with either grouped matmul and on meshes whose experts are split over ep and tp (all-to-all over ep). And
the expert FLOPs it executes per token (flops.py), against 6 × the active parameters."""
import functools

import numpy as np
import pytest

from portable_fsdp import routed_blocks
from portable_fsdp.plan import MeshSpec
from tests.flax.conftest import needs_devices

EXPERTS, HIDDEN, INTERMEDIATE = 4, 16, 24
TOLERANCE = 1e-5


def dense(x, weights, chosen, gate_up, down):
    """Every expert on every token, weighted by the router (zero for the experts a token did not choose)."""
    import jax
    import jax.numpy as jnp

    combine = jnp.einsum("bsk,bske->bse", weights, jax.nn.one_hot(chosen, gate_up.shape[0], dtype=weights.dtype))
    gate_up_out = jnp.einsum("bsh,ephi->ebspi", x, gate_up)
    out = jnp.einsum("ebsi,eih->ebsh", jax.nn.silu(gate_up_out[..., 0, :]) * gate_up_out[..., 1, :], down)
    return jnp.einsum("ebsh,bse->bsh", out, combine)


def routing(top_k: int, rows: int = 4, seq: int = 12, skew: float = 0.0, unused: tuple = ()):
    """(x, weights, chosen, gate_up, down): random tokens and experts; `skew` makes the later experts more popular,
    `unused` experts are chosen by no token."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 5)
    scores = jax.random.normal(keys[0], (rows, seq, EXPERTS)) + skew * jnp.arange(EXPERTS)
    scores = scores.at[..., list(unused)].set(-1e9)
    top, chosen = jax.lax.top_k(jax.nn.softmax(scores, axis=-1), top_k)
    weights = top / jnp.sum(top, axis=-1, keepdims=True)
    x = jax.random.normal(keys[1], (rows, seq, HIDDEN))
    gate_up = jax.random.normal(keys[2], (EXPERTS, 2, HIDDEN, INTERMEDIATE)) * 0.2
    down = jax.random.normal(keys[3], (EXPERTS, INTERMEDIATE, HIDDEN)) * 0.2
    return x, weights, chosen, gate_up, down


def value_and_grads(layer, x, weights, chosen, gate_up, down):
    """The layer's output and the gradients of a random projection of it for x, weights, gate_up and down."""
    import jax

    probe = jax.random.normal(jax.random.key(1), x.shape)

    def loss(x, weights, gate_up, down):
        out = layer(x, weights, chosen, gate_up, down)
        return (out * probe).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, weights, gate_up, down)
    return out, grads


def assert_same(mine, reference):
    import jax

    # 1e-5 of the values' scale (tests/xla/test_moe.py states the bar the same way): gate_up's gradients reach ~8.4
    # here, and float32 sums of them in another block order differ by up to 1.1e-5 absolute, 1.4e-6 relative
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(reference)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= TOLERANCE * max(1.0, np.abs(b).max())


CASES = {"top2_even": dict(top_k=2), "top2_uneven_one_empty": dict(top_k=2, skew=1.5, unused=(1,)),
         "top1_uneven_two_empty": dict(top_k=1, skew=2.0, unused=(0, 2))}


@pytest.mark.parametrize("case", CASES)
def test_routed_experts_equal_every_expert_on_every_token(case):
    from portable_fsdp.backends.flax import moe

    inputs = routing(**CASES[case])
    routed = functools.partial(moe.routed_experts, mesh=None, expert_axes=())
    assert_same(value_and_grads(routed, *inputs), value_and_grads(dense, *inputs))


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_either_grouped_matmul_runs_each_row_through_its_expert(platform):
    """ragged_dot (GPU, TPU) and the blocks (CPU) alike, gradients included; rows of expert E (none) are not read."""
    import jax
    import jax.numpy as jnp

    from portable_fsdp.backends.flax import moe

    x, _, _, gate_up, down = routing(top_k=1)
    rows = x.reshape(-1, HIDDEN)
    experts = jnp.asarray(np.random.default_rng(0).choice([0, 0, 0, 2, 3, EXPERTS], rows.shape[0]))
    kernel = moe.kernel_for(platform)

    def one_by_one(rows, gate_up, down):
        picked = jnp.minimum(experts, EXPERTS - 1)
        gate_up_out = jnp.einsum("nh,nphi->npi", rows, gate_up[picked])
        out = jnp.einsum("ni,nih->nh", jax.nn.silu(gate_up_out[:, 0]) * gate_up_out[:, 1], down[picked])
        return jnp.where((experts < EXPERTS)[:, None], out, 0)

    def routed(rows, gate_up, down):
        return jnp.where((experts < EXPERTS)[:, None], moe.expert_mlp(rows, experts, gate_up, down, kernel), 0)

    def outputs_and_grads(f):
        probe = jax.random.normal(jax.random.key(1), rows.shape)
        grads = jax.jit(jax.grad(lambda *a: (f(*a) * probe).sum(), argnums=(0, 1, 2)))(rows, gate_up, down)
        return jax.jit(f)(rows, gate_up, down), grads

    assert_same(outputs_and_grads(routed), outputs_and_grads(one_by_one))


def test_the_grouped_matmul_is_ragged_dot_on_accelerators_and_blocks_on_cpu():
    """XLA lowers ragged_dot on CPU to every group over every row; GPU and TPU run it as a grouped matmul."""
    from portable_fsdp.backends.flax import moe

    assert moe.kernel_for("gpu") is moe.kernel_for("tpu") is moe.ragged_mlp
    assert moe.kernel_for("cpu") is moe.block_mlp
    assert moe.kernel_for("gpu", "gpu") is moe.kernel_for("tpu", "tpu") is moe.ragged_mlp
    assert moe.kernel_for("cpu", "cpu") is moe.block_mlp


def test_an_estimate_for_an_accelerator_traces_the_buffers_of_its_grouped_matmul():
    """Compiled on host devices for a GPU or TPU (a memory estimate), the layer traces the stand-in: its gradients
    have the kernel's shapes, its FLOPs are one matmul over the rows per product (as ragged_dot's on a GPU), and
    XLA gives it a fraction of the temporaries of ragged_dot's CPU lowering (a copy of the rows per expert) or of
    the CPU blocks (the experts' weights per block)."""
    import jax
    import jax.numpy as jnp

    from portable_fsdp.backends.flax import moe

    assert moe.kernel_for("gpu", "cpu") is moe.kernel_for("tpu", "cpu") is moe.grouped_stand_in
    n, experts, hidden, inner = 2048, 16, 128, 256
    rows = jnp.zeros((n, hidden))
    chosen = jnp.asarray(np.random.default_rng(0).integers(0, experts, n), jnp.int32)
    gate_up, down = jnp.zeros((experts, 2, hidden, inner)), jnp.zeros((experts, inner, hidden))

    def compiled(kernel):
        def loss(*args):
            return jnp.sum(moe.expert_mlp(args[0], chosen, *args[1:], kernel) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(rows, gate_up, down).compile()

    stand_in, ragged_on_cpu, blocks = (compiled(k) for k in (moe.grouped_stand_in, moe.ragged_mlp, moe.block_mlp))
    grads = jax.eval_shape(jax.grad(lambda *a: jnp.sum(moe.expert_mlp(a[0], chosen, *a[1:], moe.grouped_stand_in)),
                                    argnums=(0, 1, 2)), rows, gate_up, down)
    assert [g.shape for g in grads] == [rows.shape, gate_up.shape, down.shape]
    assert stand_in.cost_analysis()["flops"] == pytest.approx(18 * n * hidden * inner, rel=0.05)
    temporaries = {name: c.memory_analysis().temp_size_in_bytes
                   for name, c in {"stand_in": stand_in, "ragged": ragged_on_cpu, "blocks": blocks}.items()}
    assert temporaries["stand_in"] * 3 < min(temporaries["ragged"], temporaries["blocks"]), temporaries


MESHES = {"ep2": (MeshSpec(fsdp_size=2, ep_size=2), 2), "ep2_is_tp2": (MeshSpec(fsdp_size=1, tp_size=2, ep_size=2), 2),
          "fsdp4_ep2": (MeshSpec(fsdp_size=4, ep_size=2), 4), "fsdp2_tp2_ep4": (MeshSpec(fsdp_size=2, tp_size=2,
                                                                                         ep_size=4), 4),
          "ep2_sp2": (MeshSpec(fsdp_size=2, ep_size=2, sp_size=2), 4),
          "hsdp2_ep2": (MeshSpec(dp_replicate_size=2, fsdp_size=2, ep_size=2), 4)}


def on_mesh(name: str):
    """(the layer on the mesh `name`, the mesh, a function placing its inputs as the model holds them)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from portable_fsdp import placement
    from portable_fsdp.backends.flax import moe, sharding

    spec, devices = MESHES[name]
    spec = spec.resolve(devices)
    mesh = sharding.build_mesh(spec, jax.devices()[:devices])
    expert_axes = placement.expert_axes(spec)
    tokens = NamedSharding(mesh, PartitionSpec(sharding.rows(mesh), sharding.sequence(mesh)))
    experts = NamedSharding(mesh, PartitionSpec(sharding.entry(sharding.split_over(mesh, expert_axes))))

    def place(x, weights, chosen, gate_up, down):
        return (*(jax.device_put(t, tokens) for t in (x, weights, chosen)),
                *(jax.device_put(t, experts) for t in (gate_up, down)))

    return functools.partial(moe.routed_experts, mesh=mesh, expert_axes=expert_axes), mesh, place


@needs_devices(4)
@pytest.mark.parametrize("name", MESHES)
@pytest.mark.parametrize("case", ["top2_uneven_one_empty", "top1_uneven_two_empty"])
def test_experts_split_over_ep_and_tp_compute_what_one_device_does(name, case):
    layer, _, place = on_mesh(name)
    inputs = routing(**CASES[case])
    assert_same(value_and_grads(layer, *place(*inputs)), value_and_grads(dense, *inputs))


@needs_devices(4)
def test_tokens_travel_to_the_experts_by_all_to_all_and_expert_weights_stay():
    import jax

    layer, _, place = on_mesh("fsdp2_tp2_ep4")
    inputs = place(*routing(top_k=2))
    hlo = jax.jit(layer).lower(*inputs).compile().as_text()
    assert "all-to-all" in hlo
    assert "all-gather" not in hlo


def test_executed_expert_flops_per_token():
    """Routed on one device: the top-k rows exactly with ragged_dot, under a quarter more in CPU blocks (against
    num_experts / top_k for every expert on every token); with ep, the room for every slot a peer could send."""
    from portable_fsdp.backends.flax import flops
    from portable_fsdp.backends.flax.architecture import LlamaArchitecture

    arch = LlamaArchitecture(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_layers=2,
                             num_heads=2, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             num_experts=8, experts_per_token=2)
    assert flops.expert_flops_per_token(arch, 1024, "gpu").ratio == 1
    assert 1 < flops.expert_flops_per_token(arch, 1024, "cpu").ratio <= 1 + 1 / routed_blocks.PADDING_SHARE
    assert flops.expert_flops_per_token(arch, 1024, "gpu", {"ep": 2}).ratio == 2
    assert flops.expert_flops_per_token(arch, 1024, "gpu", {"ep": 2, "tp": 2}).ratio == 4
    # one expert a device: a device computes its expert on the ep group's tokens at most, as dense would
    assert flops.expert_flops_per_token(arch, 1024, "gpu", {"ep": 4, "tp": 2}).ratio == 8 / 2


def test_the_flop_count_is_what_xla_compiles():
    """The forward's FLOPs as XLA counts them on CPU (the block kernel) against a third of the count per token:
    the count is the kernel's own shapes; the rest (routing, SiLU, combining) is a few percent."""
    import jax
    import jax.numpy as jnp

    from portable_fsdp.backends.flax import flops, moe
    from portable_fsdp.backends.flax.architecture import LlamaArchitecture

    if jax.default_backend() != "cpu":
        pytest.skip("XLA's CPU cost analysis of the CPU kernel")
    arch = LlamaArchitecture(vocab_size=64, hidden_size=64, intermediate_size=256, num_layers=1, num_heads=2,
                             num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             num_experts=8, experts_per_token=2)
    rows, seq, top_k = 4, 128, arch.experts_per_token
    chosen = jnp.asarray(np.random.default_rng(0).integers(0, arch.num_experts, (rows, seq, top_k)))
    gate_up = jnp.zeros((arch.num_experts, 2, arch.hidden_size, arch.intermediate_size))
    down = jnp.zeros((arch.num_experts, arch.intermediate_size, arch.hidden_size))
    x, weights = jnp.zeros((rows, seq, arch.hidden_size)), jnp.zeros((rows, seq, top_k))
    layer = functools.partial(moe.routed_experts, mesh=None, expert_axes=())
    cost = jax.jit(layer).lower(x, weights, chosen, gate_up, down).compile().cost_analysis()
    counted = flops.expert_flops_per_token(arch, rows * seq, "cpu")
    assert cost["flops"] == pytest.approx(counted.executed / 3 * rows * seq, rel=0.03)


@needs_devices(2)
def test_the_estimate_reports_the_executed_expert_flops(tmp_path_factory, monkeypatch):
    """Mixtral's 2 of 4 experts on ep 2: on a GPU each device keeps room for its 2 experts on every token of both
    ep ranks, twice the active expert FLOPs; the program compiled for it traces the GPU's grouped matmul (its
    stand-in on these host devices), not the CPU's blocks."""
    from portable_fsdp.backends.flax import estimate, moe
    from portable_fsdp.estimate.report import expert_flops_line
    from tests.flax.conftest import make_config
    from tests.parity import families

    traced = []
    stand_in = moe.grouped_stand_in
    monkeypatch.setattr(moe, "grouped_stand_in", lambda *args: traced.append(args[0].shape) or stand_in(*args))
    monkeypatch.setattr(moe, "block_mlp", lambda *args: pytest.fail("the CPU kernel traced for a GPU"))
    config = make_config({**families.overrides(families.saved(tmp_path_factory, "mixtral")), "plan.ep_size": 2})
    result = estimate.estimate_memory({"config": config.to_dict(), "world": 2, "device": "gpu"})
    assert traced  # one per MoE layer and trace
    counted = result["expert_flops_per_token"]
    assert counted["executed"] == 2 * counted["active"]
    assert expert_flops_line(counted).startswith(f"experts: {counted['executed']:.3g} FLOPs per token executed, 2.00x")
