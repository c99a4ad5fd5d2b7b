"""The jitted programs a run executes: the training update, the eval loss sum, the predictions.

Each is compiled once per batch shape with explicit shardings: parameters and optimizer state as
the plan places them (sharding.py), batches split by rows over the data axes and along the sequence
over cp or sp; activations placed by the mesh's Layout. Parameters are cast to the compute dtype inside the
program (mixed precision: float32 masters, gradients flow back to them through the cast).

A MoE model whose config sets output_router_logits trains on Σ token losses / Σ label tokens + coef × the
router's load-balancing loss, as transformers' MixtralForCausalLM adds it. That loss is computed per
micro-batch over all of its rows (every device's — the global batch, never one device's share) and averaged over
the micro-batches of a step, so accumulating gradients over k micro-batches of n rows trains as one batch of
k·n rows would with its load-balancing loss taken per micro-batch. eval_loss stays Σ token losses / Σ tokens.

A loss of the user's own (`loss(outputs, LossInputs) -> (sum, count)`, portable_fsdp/training/parts.py) is traced
into the programs on whole micro-batches (the global rows, the whole sequence: sharding never changes what it
sees). The training loss is then Σ sum / Σ count over the micro-batches: the gradients of Σ sum are accumulated and
divided once by Σ count.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from portable_fsdp import placement
from portable_fsdp.backends.flax import optimizer as optimizer_lib, sharding
from portable_fsdp.backends.flax.loss import token_loss_sum
from portable_fsdp.backends.flax.model import ModelDef
from portable_fsdp.backends.flax.user_model import logits_of
from portable_fsdp.training.loss_chunks import Chunking
from portable_fsdp.training.parts import LossInputs


@dataclasses.dataclass(frozen=True)
class Programs:
    # (params, opt_state, input_ids, labels, positions [A, b, s], label_tokens, lr) -> (params, opt_state, metrics:
    # loss_sum, count — a user's loss's Σ count, else the label tokens given —, router_loss — coef × the mean
    # load-balancing loss, 0 without one —, grad_norm, finite)
    train: Callable
    # (params, input_ids, labels, positions [b, s]) -> {"loss_sum": Σ token losses[, "count": a user's loss's
    # Σ count]}
    eval_loss_sum: Callable
    predict: Callable  # (params, input_ids, positions, return_logits) -> {"predictions"[, "logits"]}


def build(model_def: ModelDef, optimizer: optax.GradientTransformation, mesh, param_sharding: dict,
          opt_sharding, compute_dtype, loss_chunk_tokens: int = 0, expert_axes: tuple = (),
          user_loss: Callable | None = None, platform: str | None = None) -> Programs:
    """`loss_chunk_tokens` (train.loss_chunk_tokens): the training and eval losses project and reduce that many
    tokens per device at a time (loss.py; the built-in model and loss only); 0 computes the whole batch's logits.
    `expert_axes`: what a MoE layer's experts are split over (placement.expert_axes). `model_def`: the built-in
    model's, or a user module's (user_model.UserModelDef); `user_loss`: the user's `loss(outputs, LossInputs) ->
    (sum, count)`; `platform`: the devices the programs are for, when not the mesh's (a memory estimate)."""
    layout = sharding.Layout(mesh, expert_axes, platform)
    coef = model_def.router_aux_loss_coef
    chunking = Chunking(loss_chunk_tokens, sharding.size_of(mesh, placement.SEQUENCE_AXES),
                        sharding.size_of(mesh, placement.DATA_AXES))

    def cast(params):
        return {name: p.astype(compute_dtype) for name, p in params.items()}

    def predicted_logits(params, input_ids, positions):
        return logits_of(model_def.forward(cast(params), input_ids, positions, layout)[0])

    def losses(params, input_ids, labels, positions):
        """(Σ token losses — or the user's loss's sum —, its count — None for the built-in loss —, the router's
        load-balancing loss)."""
        if chunking.tokens:
            total, balance = model_def.loss_sum(cast(params), input_ids, positions, labels, chunking, layout)
            return total, None, balance
        outputs, balance = model_def.forward(cast(params), input_ids, positions, layout)
        if user_loss is None:
            return token_loss_sum(logits_of(outputs), labels), None, balance
        total, count = user_loss(outputs, LossInputs(input_ids, labels, positions))
        return jnp.asarray(total, jnp.float32), jnp.asarray(count, jnp.float32), balance

    def loss_sum(params, input_ids, labels, positions):
        total, count, _ = losses(params, input_ids, labels, positions)
        return {"loss_sum": total} if count is None else {"loss_sum": total, "count": count}

    def train(params, opt_state, input_ids, labels, positions, label_tokens, lr):
        micro_batches = input_ids.shape[0]
        # The built-in loss's denominator is known before the step (label tokens, counted on the host); a user's
        # count only once every micro-batch has run: its gradients are divided after the accumulation.
        known = label_tokens if user_loss is None else 1.0

        def scaled_loss(p, micro):
            ids, labels, positions = micro
            total, count, balance = losses(p, ids, labels, positions)
            router = coef * balance / micro_batches
            aux = (total, 0.0 if count is None else count, router)
            return total / known + router, aux  # torch scales each micro-batch's backward so

        def accumulate(grad_sum, micro):
            grads, totals = jax.grad(scaled_loss, has_aux=True)(params, micro)
            grads = jax.lax.with_sharding_constraint(grads, param_sharding)  # reduce-scattered, as FSDP
            return jax.tree.map(jnp.add, grad_sum, grads), totals

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (totals, counts, routers) = jax.lax.scan(accumulate, zeros, (input_ids, labels, positions))
        count = label_tokens
        if user_loss is not None:
            count = counts.sum()
            grads = jax.tree.map(lambda g: g / count, grads)
        loss_total, router_loss, grad_norm = totals.sum(), routers.sum(), optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, optimizer_lib.with_learning_rate(opt_state, lr), params)
        # A NaN/inf loss or gradient leaves parameters and AdamW's state as they were (torch skips
        # optimizer.step); the host then stops or skips the step as train.nonfinite says.
        finite = jnp.isfinite(loss_total) & jnp.isfinite(router_loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (optax.apply_updates(params, updates), new_opt_state), (params, opt_state))
        return params, opt_state, {"loss_sum": loss_total, "count": count, "router_loss": router_loss,
                                   "grad_norm": grad_norm, "finite": finite}

    def predict(params, input_ids, positions, return_logits):
        logits = predicted_logits(params, input_ids, positions).astype(jnp.float32)
        out = {"predictions": jnp.argmax(logits, axis=-1)}
        if return_logits:
            out["logits"] = logits
        return out

    one = sharding.replicated(mesh)
    stacked, flat = sharding.batch_sharding(mesh, leading_axes=1), sharding.batch_sharding(mesh)
    return Programs(
        train=jax.jit(train, in_shardings=(param_sharding, opt_sharding, stacked, stacked, stacked, one, one),
                      out_shardings=(param_sharding, opt_sharding, one), donate_argnums=(0, 1)),
        eval_loss_sum=jax.jit(loss_sum, in_shardings=(param_sharding, flat, flat, flat), out_shardings=one),
        predict=jax.jit(predict, static_argnums=3))
