"""Hugging Face TrainingArguments onto our config (portable_fsdp/config/training_arguments.py)."""
import json
import warnings

import pytest

pytest.importorskip("transformers")
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.utils import TorchContextParallelConfig  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

import portable_fsdp as pf  # noqa: E402
from portable_fsdp.config.training_arguments import from_training_arguments  # noqa: E402
from portable_fsdp.training import schedule  # noqa: E402
from tests.unit._helpers import user_error  # noqa: E402


def arguments(**values):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own deprecation notes (fsdp as words)
        return TrainingArguments(**{"max_steps": 40, **values})


def convert(args, *recipe, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a mapped value must not also warn
        return from_training_arguments(args, *recipe, **kwargs)


def test_every_mapped_argument_lands_on_its_field():
    args = arguments(
        max_steps=40, per_device_train_batch_size=3, gradient_accumulation_steps=2, per_device_eval_batch_size=5,
        learning_rate=2e-4, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 5e-5},
        warmup_steps=0.1, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.97, adam_epsilon=1e-6, max_grad_norm=0.5,
        eval_strategy="steps", eval_steps=0.25, save_strategy="steps", save_steps=0.5, save_total_limit=4,
        logging_steps=4, bf16=True, use_cpu=True, gradient_checkpointing=True, seed=11, data_seed=11, report_to="tensorboard",
        torch_compile=True, disable_tqdm=True, ddp_timeout=600, load_best_model_at_end=True,
        fsdp="shard_grad_op offload", fsdp_config={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                                   "state_dict_type": "SHARDED_STATE_DICT"},
        parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2,
                                             cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall")))
    with pytest.warns(UserWarning, match="one step earlier") as caught:
        config = pf.from_training_arguments(args, "llama_tiny:test")
    t, p = config.train, config.plan
    assert (t.steps, t.grad_accum_steps) == (40, 2)
    assert t.batch_size == 3 * 2 * 4  # per device x accumulation x data-parallel (2 replicas x 2 shards)
    assert t.eval_batch_size == 5 * 4
    assert (t.lr, t.lr_schedule, t.min_lr_ratio, t.warmup_steps) == (2e-4, "cosine", 0.25, 4)
    assert (t.weight_decay, t.beta1, t.beta2, t.eps, t.max_grad_norm) == (0.05, 0.8, 0.97, 1e-6, 0.5)
    assert (t.eval_every, t.save_every, t.keep_last_n, t.log_every) == (10, 20, 4, 4)
    assert t.load_best_model_at_end is True
    assert (p.param_dtype, t.gradient_checkpointing, p.compile) == ("bfloat16", True, True)
    assert (config.seed, t.report_to, t.progress_bar, t.collective_timeout_s) == (11, "tensorboard", False, 600)
    assert (p.reshard_after_forward, p.cpu_offload) == (False, True)
    assert (list(p.transformer_layer_cls_to_wrap), p.state_dict_type) == (["LlamaDecoderLayer"], "SHARDED_STATE_DICT")
    assert (p.dp_replicate_size, p.fsdp_size, p.cp_size, p.tp_size, p.sp_size) == (2, 2, 2, 1, 1)
    assert p.cp_rotate_method == "alltoall"
    assert p.xla_fsdp_v2 is True  # TrainingArguments' own xla_fsdp_v2=false is not the user's
    assert [str(w.message) for w in caught if "output_dir" in str(w.message)] == []  # output_dir left at its default
    pf.plan_for(config, world_size=8)  # the config is one the run accepts


def test_defaults_pass_silently_and_mean_what_trainer_does():
    config = convert(arguments(), world_size=1)
    t = config.train
    assert (t.lr, t.lr_schedule, t.min_lr_ratio, t.warmup_steps) == (5e-5, "linear", 0.0, 0)
    assert (t.batch_size, t.eval_batch_size, t.grad_accum_steps) == (8, 8, 1)
    assert (t.weight_decay, t.beta2, t.max_grad_norm, config.seed) == (0.0, 0.999, 1.0, 42)
    assert (t.eval_every, t.save_every, t.log_every, t.report_to) == (0, 500, 500, "none")
    assert config.plan.param_dtype == "float32"


def test_num_train_epochs_without_max_steps_trains_by_epochs():
    config = convert(arguments(max_steps=-1, num_train_epochs=3, logging_steps=2), world_size=1)
    assert (config.train.steps, config.train.epochs, config.train.log_every) == (0, 3.0, 2)


@pytest.mark.parametrize("optim, optim_args, optimizer, momentum", [
    ("adamw_torch_fused", None, "adamw", None), ("sgd", None, "sgd", 0.0), ("sgd", "momentum=0.9", "sgd", 0.9),
    ("lion_32bit", None, "lion", None)])
def test_trainers_optimizers_become_the_same_update(optim, optim_args, optimizer, momentum):
    config = convert(arguments(optim=optim, optim_args=optim_args, adam_beta2=0.99), world_size=1)
    assert (config.train.optimizer, config.train.beta2) == (optimizer, 0.99)  # Lion's betas: adam_beta1/2, as Trainer
    if momentum is not None:
        assert config.train.momentum == momentum


def test_world_size_converts_the_per_device_batch(monkeypatch, tmp_path):
    args = arguments(per_device_train_batch_size=2, gradient_accumulation_steps=3, per_device_eval_batch_size=1)
    assert convert(args, world_size=4).train.batch_size == 2 * 3 * 4
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun / accelerate launch set it
    config = convert(args)
    assert (config.train.batch_size, config.train.eval_batch_size) == (24, 4)
    recipe = tmp_path / "tp2.py"  # the recipe's mesh: the ranks of a tp group share one batch
    recipe.write_text("from portable_fsdp.configs.llama_tiny import get_config as tiny\n\n\n"
                      "def get_config():\n    config = tiny()\n    config.plan.tp_size = 2\n    return config\n")
    assert convert(args, str(recipe)).train.batch_size == 2 * 3 * 2


def test_fsdp_config_file(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_activation_checkpointing": True, "fsdp_cpu_ram_efficient_loading": True}))
    config = convert(arguments(fsdp_config=str(path)), world_size=1)
    assert config.plan.activation_checkpointing and config.plan.cpu_ram_efficient_loading


@pytest.mark.parametrize("kind, kwargs", [("linear", {}), ("cosine", {}), ("constant", {}),
                                          ("constant_with_warmup", {}), ("cosine_with_min_lr", {"min_lr_rate": 0.1})])
def test_schedule_equals_trainers(kind, kwargs):
    """Trainer's own scheduler and ours give the same rate at every step (no warm-up: ours starts it a step early)."""
    import torch
    from transformers import get_scheduler

    args = arguments(max_steps=30, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, learning_rate=1e-3)
    ours = schedule.for_config(convert(args, world_size=1).train)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    theirs = get_scheduler(kind, optimizer, num_warmup_steps=0, num_training_steps=30, scheduler_specific_kwargs=kwargs)
    rates = []
    for _ in range(30):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        theirs.step()
    assert [ours(step) for step in range(30)] == pytest.approx(rates)


@pytest.mark.parametrize("values, field, phrase", [
    ({"label_smoothing_factor": 0.1}, "TrainingArguments.label_smoothing_factor",
     "has no equivalent in portable_fsdp; leave it at its default (0.0)"),
    ({"max_steps": -1, "num_train_epochs": 0}, "TrainingArguments.num_train_epochs",
     "is 0 and max_steps is -1: give the passes over the data to train, or max_steps"),
    ({"max_steps": -1, "num_train_epochs": 2, "warmup_steps": 0.1}, "TrainingArguments.warmup_steps",
     "is 0.1, a fraction of the run's steps, which num_train_epochs leaves unknown"),
    ({"optim": "sgd", "optim_args": "nesterov=True"}, "TrainingArguments.optim_args",
     "nesterov has no equivalent for sgd; leave optim_args unset or give only momentum"),
    ({"lr_scheduler_type": "polynomial"}, "TrainingArguments.lr_scheduler_type", "polynomial has no equivalent"),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 1.0}},
     "TrainingArguments.lr_scheduler_kwargs", "num_cycles other than 0.5"),
    ({"optim": "adafactor"}, "TrainingArguments.optim", "adafactor has no equivalent here; choose one of adamw_torch"),
    ({"data_seed": 3}, "TrainingArguments.data_seed", "apart from seed 42"),
    ({"eval_strategy": "epoch"}, "TrainingArguments.eval_strategy", "epoch has no equivalent"),
    ({"report_to": "mlflow"}, "TrainingArguments.report_to", "mlflow has no equivalent"),
    ({"eval_strategy": "steps", "eval_steps": 10, "save_steps": 10, "load_best_model_at_end": True,
      "metric_for_best_model": "accuracy"}, "TrainingArguments.metric_for_best_model", "lowest eval_loss"),
])
def test_refusals(values, field, phrase):
    args = arguments(**values)
    with user_error(field, phrase):
        from_training_arguments(args, world_size=1)


def test_only_training_arguments_are_taken():
    with user_error("args", "must be a transformers.TrainingArguments (got dict)"):
        from_training_arguments({"learning_rate": 1e-3})


def test_world_size_must_match_the_parallelism_config():
    args = arguments(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    with user_error("world_size", "is 8 but TrainingArguments.parallelism_config's sizes multiply to 4"):
        from_training_arguments(args, world_size=8)


def test_output_dir_is_named_as_the_workdir():
    with pytest.warns(UserWarning, match=r"pass it as pf.train\(config, workdir='runs/mine'\)"):
        from_training_arguments(arguments(output_dir="runs/mine"), world_size=1)


@pytest.mark.parametrize("words", ["shard_grad_op offload", ["shard_grad_op", "offload"]])
def test_fsdp_words_kept_as_transformers_4_kept_them(words):
    args = arguments()
    args.fsdp = words  # transformers 5 moves them into fsdp_config while constructing; 4 kept them here
    config = convert(args, world_size=1)
    assert (config.plan.reshard_after_forward, config.plan.cpu_offload) == (False, True)


def test_fp16():
    assert convert(arguments(fp16=True), world_size=1).plan.param_dtype == "float16"
