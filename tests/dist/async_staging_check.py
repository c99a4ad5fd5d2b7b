"""Run by test_save_process.py under torchrun (2 ranks): a background save's copy of the state is made while the
next step computes its gradients, and that step's update waits for it. The copy is slowed down here (2 s), so an
update that did not wait would leave the next step's weights in the checkpoint."""
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from portable_fsdp import backends

from portable_fsdp.checkpoint import async_save, session as checkpoint_session
from portable_fsdp.backends.torch import checkpoint
from portable_fsdp.config.schema import apply_override, load_recipe
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.config.validate import resolve_plan


def main() -> None:
    workdir = pathlib.Path(sys.argv[1])
    config = load_recipe(None)
    for key, value in {"model.hidden_size": 64, "model.intermediate_size": 128, "model.num_hidden_layers": 2,
                       "model.num_attention_heads": 4, "model.num_key_value_heads": 2, "data.seq_len": 32,
                       "train.batch_size": 2, "train.progress_bar": "false", "train.async_save": "true",
                       "plan.state_dict_type": "SHARDED_STATE_DICT"}.items():
        apply_override(config, key, str(value))
    world = int(os.environ["WORLD_SIZE"])
    plan = resolve_plan(config, world)
    backend = backends.load("cpu")
    state = backend.init(config, plan, "cpu")
    where = backend.placement(state)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed, None)
    state, _ = backend.train_step(state, batches.micro_batches(0, where.dp_rank, where.dp_size))

    stage = checkpoint._stager("cpu").stage
    slowed = lambda bundle: time.sleep(2) or stage(bundle)  # noqa: E731
    checkpoint._stager("cpu").stage = slowed
    before = {name: t.full_tensor().clone() for name, t in get_model_state_dict(state.model).items()}
    info = checkpoint_session.manifest_info(config, plan, "cpu", where)
    began = time.perf_counter()
    final = checkpoint_session.save(backend, state, workdir, info, keep_last_n=1)
    assert time.perf_counter() - began < 1.5, "the save waited for the copy"
    state, _ = backend.train_step(state, batches.micro_batches(1, where.dp_rank, where.dp_size))
    after = {name: t.full_tensor() for name, t in get_model_state_dict(state.model).items()}
    assert any(not torch.equal(before[n], after[n]) for n in before), "the step changed no weight"
    async_save.finish()
    dist.barrier()

    saved = {"model": get_model_state_dict(state.model)}
    dcp.load(saved, checkpoint_id=str(final / "sharded"))
    for name, tensor in saved["model"].items():
        assert torch.equal(tensor.full_tensor(), before[name]), f"{name}: the checkpoint holds the next step's weights"
    dist.barrier()
    backend.finalize(state)
    print(f"rank {where.rank}: ok", flush=True)


if __name__ == "__main__":
    main()
