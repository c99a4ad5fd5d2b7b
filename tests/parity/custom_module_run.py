"""One backend's side of the custom-module parity check, run in its own process (each framework fixes its devices
once per process):

    python tests/parity/custom_module_run.py {cpu|xla|flax} OUT.json STEPS

Trains the example non-transformers module (examples/custom_model: torch_mlp.py on cpu and xla, its flax.nnx twin
nnx_mlp.py on flax, holding the same seeded weights) through the Python API with a custom loss, a custom optimizer
(SGD with momentum, torch's and optax's) and a custom schedule, on the loop's own batches, and writes the per-step
losses and learning rates. cpu: one gloo rank; xla: SPMD over 2 PJRT CPU devices; flax: 2 JAX host devices.
"""
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DEVICES = 2
OVERRIDES = {"train.steps": 6, "train.batch_size": 4, "train.max_grad_norm": 1.0}


def schedule(step):
    """A warm-up to 0.05 over 3 steps, then constant: the same Python function on every backend."""
    return 0.05 * min(1.0, (step + 1) / 3)


def torch_parts(vocab_size: int):
    import torch
    import torch.nn.functional as F

    from examples.custom_model.torch_mlp import MLPLanguageModel

    def loss(outputs, batch):  # the token mean, written out: Σ cross-entropy and the label tokens
        logits = outputs.float().flatten(0, 1)
        labels = batch.labels.flatten()
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"), (labels != -100).sum()

    torch.manual_seed(0)
    model = MLPLanguageModel(vocab_size=vocab_size)
    model.init_weights()
    return model, loss, lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.9)


def flax_parts(vocab_size: int):
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from examples.custom_model.nnx_mlp import MLPLanguageModel, load_torch_state_dict

    reference, _, _ = torch_parts(vocab_size)
    model = MLPLanguageModel(vocab_size=vocab_size, rngs=nnx.Rngs(0))
    load_torch_state_dict(model, {k: v.numpy() for k, v in reference.state_dict().items()})

    def loss(outputs, batch):
        labels = batch.labels
        mask = labels != -100
        losses = optax.softmax_cross_entropy_with_integer_labels(outputs.astype(jnp.float32), jnp.where(mask, labels, 0))
        return jnp.sum(jnp.where(mask, losses, 0.0)), jnp.sum(mask)

    return model, loss, optax.inject_hyperparams(optax.sgd)(learning_rate=0.0, momentum=0.9)


def main() -> None:
    backend_name, out, steps = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3])
    if backend_name == "xla":
        from portable_fsdp.backends.xla import environment

        environment.configure(DEVICES)
        os.environ.setdefault("PJRT_DEVICE", "CPU")
    elif backend_name == "flax":
        from portable_fsdp.backends.flax.devices import configure_host_devices

        configure_host_devices(DEVICES)
    import portable_fsdp as pf

    config = pf.get_config("llama_tiny:test", {**OVERRIDES, "train.steps": steps})
    parts = flax_parts if backend_name == "flax" else torch_parts
    model, loss, optimizer = parts(config.model.vocab_size)
    world = 1 if backend_name == "cpu" else DEVICES
    plan = pf.plan_for(config, world_size=world, backend=backend_name, model=model)
    backend = pf.load_backend(backend_name)
    state = pf.init(config, plan, backend_name, model=model, loss=loss, optimizer=optimizer, schedule=schedule)
    data = pf.Batches(config, backend, state)
    losses, rates = [], []
    for step in range(steps):
        state, metrics = backend.train_step(state, data.train(step))
        losses.append(metrics["loss"])
        rates.append(metrics["lr"])
    result = {"losses": losses, "lr": rates, "eval_loss": pf.evaluate(backend, state, data.eval)["eval_loss"]}
    backend.finalize(state)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
