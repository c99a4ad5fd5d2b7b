"""One side of the cross-backend checkpoint check, run in its own process:

    python tests/xla/cross_backend.py {cpu|xla} OUT.json [--load DIR STEP] [--train FROM TO] [--save DIR]

Builds the seeded model with the chosen backend (cpu: the torch backend, one gloo rank; xla: SPMD on 2 PJRT
CPU devices), evaluates it with the shared eval layer, optionally loads a FULL checkpoint (weights and
optimizer) and evaluates again, trains steps FROM..TO-1, saves a FULL checkpoint and evaluates once more.
"""
import argparse
import json
import os
import pathlib
import socket
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
XLA_DEVICES = 2


def _prepare(backend_name: str) -> int:
    """The process environment each backend expects, before its framework starts; returns the world size."""
    if backend_name == "xla":
        from portable_fsdp.backends.xla import environment

        environment.configure(XLA_DEVICES)
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        return XLA_DEVICES
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    return 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["cpu", "xla"])
    parser.add_argument("out")
    parser.add_argument("--load", nargs=2, metavar=("DIR", "STEP"))
    parser.add_argument("--train", nargs=2, type=int, metavar=("FROM", "TO"))
    parser.add_argument("--save")
    args = parser.parse_args()
    world = _prepare(args.backend)

    from portable_fsdp import backends
    from portable_fsdp.data.batch import EvalBatches
    from portable_fsdp.data.loader import TrainBatches, build_token_data
    from portable_fsdp.training.evaluation import evaluate
    from portable_fsdp.config.validate import resolve_plan
    from tests.parity.matrix import make_config

    config = make_config({})
    backend = backends.load(args.backend)
    state = backend.init(config, resolve_plan(config, world), args.backend)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    evals = EvalBatches(data.eval, config.train.eval_batch_size, 0, 1, 4)
    result = {"initial_eval": evaluate(backend, state, evals)["eval_loss"]}
    if args.load:
        directory, step = args.load
        manifest = json.loads((pathlib.Path(directory) / "manifest.json").read_text())
        state = backend.load_checkpoint(state, directory, {**manifest, "step": int(step)})
        result["loaded_eval"] = evaluate(backend, state, evals)["eval_loss"]
    if args.train:
        batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed)
        result["losses"] = []
        for step in range(*args.train):
            state, metrics = backend.train_step(state, batches.micro_batches(step, 0, 1))
            result["losses"].append(metrics["loss"])
    if args.save:
        pathlib.Path(args.save).mkdir(parents=True, exist_ok=True)
        backend.save_checkpoint(state, args.save)
        # What checkpoint_session.save's manifest records and the loaders read.
        (pathlib.Path(args.save) / "manifest.json").write_text(json.dumps(
            {"backend": args.backend, "world_size": world, "step": state.step}))
        result["saved_eval"] = evaluate(backend, state, evals)["eval_loss"]
    pathlib.Path(args.out).write_text(json.dumps(result))
    backend.finalize(state)


if __name__ == "__main__":
    main()
