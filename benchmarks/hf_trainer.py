"""The Hugging Face side of a throughput comparison: `Trainer` + Accelerate with FSDP2, on CPU (gloo) or on
CUDA GPUs (NCCL; `device="cuda"`, what benchmarks/gpu.py runs).

    python -m benchmarks.hf_trainer      # a tiny smoke comparison with our CLI

`run_hf_trainer(model_overrides, seq_len, global_batch, steps, ...)` trains the model our config builds (the
same `--config.model.*=...` overrides our CLI takes, the same seed) on our bundled corpus, with our AdamW
hyper-parameters and schedule in fp32 (or, with `bf16=True`, Trainer's `bf16`: FSDP2 mixed precision with
bfloat16 parameters, reductions and outputs), under `torchrun`, and returns the step times and tokens/s. The work per
step is the same as ours; the losses are close, not equal: Trainer's warm-up starts at 0 (one step behind ours)
and it draws batches with its own seeded sampler.

Accelerate (1.15) turns the FSDP plugin Trainer gives it on only for GPU-like backends: on CPU
(`DistributedType.MULTI_CPU`) Trainer with `fsdp=...` silently trains with DDP. The worker's `FSDP2Trainer` makes
Accelerate's state FSDP, and every run checks after training that the model really is FSDP2-sharded.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

from benchmarks.common import parse_benchmark_args, TINY_MODEL, config_from_flags, run_cli, table, torchrun


def run_hf_trainer(model_overrides: list[str], seq_len: int, global_batch: int, steps: int, nproc: int = 2,
                   timeout: int = 1200, device: str = "cpu", bf16: bool = False) -> dict:
    """Train `steps` optimizer steps on `nproc` ranks of `device` (cpu or cuda); returns the rank-0 result plus
    tokens_per_sec (median step after the first, which pays for warm-up) and peak_mem_mb (rank 0's
    max_memory_allocated on cuda, peak resident set on cpu)."""
    if global_batch % nproc:
        raise ValueError(f"global_batch {global_batch} must split evenly over {nproc} ranks")
    _config(model_overrides, seq_len, global_batch, steps)  # a bad override fails here, once, not on every rank
    threads = max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory() as workdir:
        spec = {"model_overrides": model_overrides, "seq_len": seq_len, "global_batch": global_batch, "steps": steps,
                "output_dir": workdir, "result": str(pathlib.Path(workdir) / "result.json"), "device": device,
                "bf16": bf16}
        # USE_TORCH_XLA=0 (set by torchrun()): with torch_xla installed Accelerate would otherwise not use gloo.
        torchrun(nproc, ["benchmarks.hf_trainer", "--worker", json.dumps(spec)], timeout,
                 env={"OMP_NUM_THREADS": str(threads)})
        result = json.loads(pathlib.Path(spec["result"]).read_text())
    result["tokens_per_sec"] = result["tokens_per_step"] / statistics.median(result["step_seconds"][1:])
    return result


def _config(model_overrides: list[str], seq_len: int, global_batch: int, steps: int):
    config = config_from_flags(model_overrides)
    config.data.seq_len, config.train.batch_size, config.train.steps = seq_len, global_batch, steps
    return config


def _worker(spec: dict) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from portable_fsdp.backends.hf_torch.model import create_model
    from portable_fsdp.data.loader import build_token_data

    class FSDP2Trainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            # On CPU, Accelerate dropped Trainer's FSDP plugin (CPU is not a backend it shards on). The FSDP branch it
            # skipped only stores the plugin (and sets its mixed precision: none here) and the type, also into
            # PartialState, which every later `AcceleratorState()` copies back; doing that now gives the state
            # a GPU run has, and `_prepare_fsdp2` then applies activation checkpointing and fully_shard. On a GPU
            # the state is already this; the final check below tells either way.
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.accelerator.state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

        def training_step(self, model, inputs, num_items_in_batch=None):
            # Trainer logs only every `logging_steps`; keep this rank's share of every step's loss.
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.step_losses.append(loss.detach())
            return loss

    cuda = spec.get("device", "cpu") == "cuda"
    wait = torch.cuda.synchronize if cuda else (lambda: None)

    class StepTimer(TrainerCallback):
        """Wall clock of each optimizer step: forward, backward, clipping, update (the batch is already fetched;
        on a GPU, the queued kernels are waited for at both ends)."""

        def __init__(self):
            self.seconds = []

        def on_step_begin(self, args, state, control, **kwargs):
            wait()
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            wait()
            self.seconds.append(time.perf_counter() - self.began)

    # As our CPU backend does: share the cores between the local ranks.
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    config = _config(spec["model_overrides"], spec["seq_len"], spec["global_batch"], spec["steps"])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    model = create_model(config, rank, rank0_only=False)
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    # Our packed sequences of seq_len + 1 tokens, labels shifted once here as in our step: `shift_labels` is
    # used as-is by the Llama loss; `labels` (the same tensor) only makes the model compute a loss.
    rows = torch.from_numpy(data.train.astype("int64"))  # the token cache stores uint16
    dataset = [{"input_ids": s[:-1], "labels": s[1:], "shift_labels": s[1:]} for s in rows]
    t = config.train
    args = TrainingArguments(
        output_dir=spec["output_dir"], max_steps=t.steps, per_device_train_batch_size=t.batch_size // world,
        learning_rate=t.lr, adam_beta1=t.beta1, adam_beta2=t.beta2, adam_epsilon=t.eps, weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps, max_grad_norm=t.max_grad_norm,
        optim="adamw_torch_fused" if cuda else "adamw_torch",  # AdamW's kernels as ours (fused on cuda)
        bf16=bool(spec.get("bf16")),
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio},
        # = fsdp="full_shard auto_wrap" without its deprecation warning (transformers 5.24)
        fsdp=True,
        fsdp_config={"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                     "transformer_layer_cls_to_wrap": list(model._no_split_modules),  # its decoder layer
                     "reshard_after_forward": config.plan.reshard_after_forward,
                     "activation_checkpointing": config.plan.activation_checkpointing},
        use_cpu=not cuda, seed=config.seed, report_to="none", save_strategy="no", eval_strategy="no",
        logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False)  # else the collator drops `shift_labels` (not a named forward argument)
    timer = StepTimer()
    trainer = FSDP2Trainer(model=model, args=args, train_dataset=dataset, callbacks=[timer])
    trainer.step_losses = []
    trainer.train()
    wrapped = trainer.model_wrapped
    if not isinstance(wrapped, FSDPModule) or not all(isinstance(p, DTensor) for p in wrapped.parameters()):
        raise RuntimeError(f"Trainer trained a {type(wrapped).__name__}, not an FSDP2-sharded model")
    peak_mb = (torch.cuda.max_memory_allocated() if cuda
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20
    losses = torch.stack(trainer.step_losses).double()
    dist.all_reduce(losses)  # the ranks' shares average to the global per-token loss
    losses = (losses / world).tolist()
    if rank == 0:
        pathlib.Path(spec["result"]).write_text(json.dumps({
            "step_seconds": timer.seconds, "tokens_per_step": t.batch_size * config.data.seq_len,
            "final_loss": losses[-1], "losses": losses, "peak_mem_mb": peak_mb}))


def _smoke() -> None:
    seq_len, batch, steps = 64, 4, 4
    ours = run_cli([*TINY_MODEL, f"--config.data.seq_len={seq_len}", f"--config.train.batch_size={batch}",
                    f"--config.train.steps={steps}", "--config.train.log_every=1", "--config.train.eval_every=0",
                    "--config.train.eval_max_batches=1"], nproc=2)
    train = [r for r in ours if "loss" in r]
    hf = run_hf_trainer(TINY_MODEL, seq_len, batch, steps)
    print(table(["framework", "tokens/s (median step)", "final loss"],
                [["portable_fsdp (FSDP2)", f"{statistics.median(r['tokens_per_sec'] for r in train[1:]):,.0f}",
                  f"{train[-1]['loss']:.4f}"],
                 ["HF Trainer (FSDP2)", f"{hf['tokens_per_sec']:,.0f}", f"{hf['final_loss']:.4f}"]]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help="internal: one torchrun rank's JSON spec")
    cli = parse_benchmark_args(parser)
    if cli.worker:
        _worker(json.loads(cli.worker))
    else:
        _smoke()
