"""The flax loss a chunk of tokens at a time (portable_fsdp/backends/flax/loss.py): the same number and gradients as the loss on
the whole batch's logits, unsharded and over a mesh, tied or not, with ignored tokens and a last chunk shorter
than the others. Training runs with small chunks: the matrix's loss_chunks variants (test_parity.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from portable_fsdp.backends.flax import model as model_lib
from portable_fsdp.backends.flax.loss import chunked_token_loss_sum, token_loss_sum
from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.training.loss_chunks import Chunking
from tests.flax.conftest import needs_devices

FP32_RTOL = 1e-6


def batch(rows=4, seq=24, features=16, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((rows, seq, features)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((features, vocab)) * 0.3, jnp.float32)
    labels = rng.integers(0, vocab, (rows, seq))
    labels[0, :7] = IGNORE_INDEX
    return hidden, kernel, jnp.asarray(labels, jnp.int32)


def relative(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("chunking", [Chunking(1), Chunking(20), Chunking(40, sequence_parts=2),
                                      Chunking(24, sequence_parts=2, row_shards=2), Chunking(10**6)],
                         ids=["one token", "uneven chunks", "two sequence parts", "over rows and parts", "one chunk"])
def test_chunked_loss_and_gradients_equal_the_whole_batch(chunking):
    hidden, kernel, labels = batch()

    def whole(h, k):
        return token_loss_sum(h @ k, labels)

    def chunked(h, k):
        return chunked_token_loss_sum(h, k, labels, chunking)

    expected, (grad_h, grad_k) = jax.value_and_grad(whole, argnums=(0, 1))(hidden, kernel)
    value, (chunk_grad_h, chunk_grad_k) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, kernel)
    assert abs(float(value - expected)) <= FP32_RTOL * abs(float(expected))
    assert relative(chunk_grad_h, grad_h) <= FP32_RTOL and relative(chunk_grad_k, grad_k) <= FP32_RTOL


def test_chunks_hold_a_chunk_of_logits_at_a_time():
    """The compiled gradient program's largest buffer is one chunk's logits, not the batch's."""
    hidden, kernel, labels = batch(rows=2, seq=256, features=8, vocab=512)

    def compiled_bytes(chunking):
        fn = jax.jit(jax.grad(lambda h, k: chunked_token_loss_sum(h, k, labels, chunking), argnums=(0, 1)))
        return fn.lower(hidden, kernel).compile().memory_analysis().temp_size_in_bytes

    whole_logits = 2 * 256 * 512 * 4
    assert compiled_bytes(Chunking(10**6)) >= whole_logits
    assert compiled_bytes(Chunking(32)) < whole_logits / 2


@needs_devices(2)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_model_loss_equals_the_logits_loss_over_a_mesh(tie):
    """ModelDef.loss_sum, rows split over 2 devices, equals Σ token losses of ModelDef.apply's logits."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from portable_fsdp.backends.flax import architecture, torch_weights
    from tests.flax.test_model import hf_llama

    hf_model = hf_llama(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    arch = architecture.from_hf_config(hf_model.config)
    model_def = model_lib.define(arch)
    params = torch_weights.from_torch(hf_model.state_dict(), model_def.variables, arch)
    rng = np.random.default_rng(3)
    ids, labels = rng.integers(0, 97, (4, 32)), rng.integers(0, 97, (4, 32))
    positions = np.broadcast_to(np.arange(32), ids.shape).copy()
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("fsdp",))
    rows = NamedSharding(mesh, PartitionSpec("fsdp", None))
    ids, labels, positions = (jax.device_put(a, rows) for a in (ids, labels, positions))
    chunking = Chunking(12, row_shards=2)

    def chunked(p):
        return model_def.loss_sum(p, ids, positions, labels, chunking)[0]

    def whole(p):
        return token_loss_sum(model_def.apply(p, ids, positions), labels)

    expected, expected_grads = jax.jit(jax.value_and_grad(whole))(params)
    value, grads = jax.jit(jax.value_and_grad(chunked))(params)
    assert abs(float(value - expected)) <= FP32_RTOL * abs(float(expected))
    assert max(relative(grads[n], g) for n, g in expected_grads.items()) <= 1e-5
