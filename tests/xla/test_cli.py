"""`python -m portable_fsdp.run --backend xla` as a user runs it: the command sets up its PJRT CPU devices,
writes the torch backend's metrics file and checkpoints, and resumes."""
import json

import pytest

from tests.conftest import TEST_RECIPE, cli, read_metrics
from tests.e2e.test_training_runs import TRAIN_KEYS, assert_memory_report
from tests.xla.helpers import XLA_ENV

ENV = {k: v for k, v in XLA_ENV.items() if k != "PJRT_DEVICE"}  # the command must choose the CPU itself


def xla_cli(workdir, *args, nproc=2):
    return cli(["--backend", "xla", "--nproc", str(nproc), "--config", TEST_RECIPE, "--workdir", str(workdir),
                *args], cwd=workdir.parent, env=ENV)


def test_xla_command_trains_evaluates_and_saves_like_the_torch_backend(tmp_path):
    proc = xla_cli(tmp_path / "run", "--config.train.eval_every=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20] and all(TRAIN_KEYS <= set(r) for r in train)
    assert all(len(r["state_mb"]) == 2 and len(r["mem_mb"]) == 2 for r in train)  # one entry per device
    assert_memory_report(records, entries=2)
    assert [e["step"] for e in evals] == [10, 20] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    final = tmp_path / "run" / "checkpoints" / "step_00000020"
    assert (final / "model.safetensors").exists() and (final / "optimizer.pt").exists()
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["backend"] == "xla" and manifest["world_size"] == 2
    assert "xla, 2 rank(s)" in proc.stdout and "graphs compiled" in proc.stdout


@pytest.mark.slow
def test_sharded_checkpoint_resumes_through_the_command(tmp_path):
    workdir = tmp_path / "run"
    sharded = ["--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.log_every=1"]
    first = xla_cli(workdir, *sharded, "--config.train.stop_at_step=10")
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (workdir / "checkpoints" / "step_00000010" / "sharded").iterdir()) == [
        "device_00000.safetensors", "device_00001.safetensors", "index.json", "optimizer_steps.pt"]
    other_mesh = xla_cli(workdir, *sharded, "--config.train.resume=true", nproc=4)
    assert other_mesh.returncode == 2 and "error: train.resume:" in other_mesh.stderr
    second = xla_cli(workdir, *sharded, "--config.train.resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    uninterrupted = xla_cli(tmp_path / "straight", "--config.train.log_every=1")
    assert uninterrupted.returncode == 0
    losses = lambda w: [r["loss"] for r in read_metrics(w) if "loss" in r]  # noqa: E731
    assert losses(workdir)[-10:] == losses(tmp_path / "straight")[-10:]


@pytest.mark.slow
def test_torch_sharded_checkpoint_is_refused_on_xla(tmp_path):
    workdir = tmp_path / "run"
    torch_run = cli(["--backend", "cpu", "--config", TEST_RECIPE, "--workdir", str(workdir),
                     "--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.stop_at_step=2"],
                    cwd=tmp_path)
    assert torch_run.returncode == 0, torch_run.stderr[-3000:]
    proc = xla_cli(workdir, "--config.train.resume=true")
    assert proc.returncode == 2
    assert "error: train.resume:" in proc.stderr and "FULL_STATE_DICT" in proc.stderr


@pytest.mark.slow
def test_fsdp_v1_command_on_one_device(tmp_path):
    proc = xla_cli(tmp_path / "run", "--config.plan.xla_fsdp_v2=false", nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "xla, 1 rank(s)" in proc.stdout


# The TPU fsdp_config of Hugging Face's guide, as TPU users have it (their model's layer class): no xla_fsdp_v2, so
# FSDP v1, as in Trainer.
HF_TPU_CONFIG = {"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "xla": True,
                 "xla_fsdp_settings": {"compute_dtype": "bfloat16", "fp32_reduce_scatter": True},
                 "xla_fsdp_grad_ckpt": True}
RECOMMENDS_V2 = ("plan.xla_fsdp_v2=false: torch_xla's FSDP v1 (one process per device), which a Hugging Face "
                 "fsdp_config with xla: true runs unless it sets xla_fsdp_v2")


def hf_tpu_run(tmp_path, fsdp_config, *args, nproc=2):
    fsdp_json = tmp_path / "fsdp.json"
    fsdp_json.write_text(json.dumps(fsdp_config))
    return cli(["--fsdp_config", str(fsdp_json), "--nproc", str(nproc), "--config", TEST_RECIPE, "--workdir",
                str(tmp_path / "run"), *args], cwd=tmp_path, env=ENV)  # --backend auto


def test_the_hf_tpu_fsdp_config_on_cpu_devices_says_what_to_write_instead(tmp_path):
    """FSDP v1 on several PJRT CPU devices aborts in torch_xla 2.9: one line at start-up. With xla_fsdp_v2 the file
    runs SPMD FSDPv2, where its compute_dtype is bf16 autocast: the attention fix is named."""
    errors = lambda proc: [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # noqa: E731
    proc = hf_tpu_run(tmp_path, HF_TPU_CONFIG)
    assert proc.returncode == 2
    assert errors(proc) == ["error: --nproc: 2: FSDP v1 (plan.xla_fsdp_v2=false) runs one process per device, and "
                            "multi-process PJRT CPU collectives abort in torch_xla 2.9; use --nproc 1 on the CPU, or "
                            "SPMD FSDPv2 for several CPU devices (plan.xla_fsdp_v2=true; in a Hugging Face "
                            'fsdp_config "xla_fsdp_v2": true)']
    proc = hf_tpu_run(tmp_path, {**HF_TPU_CONFIG, "xla_fsdp_v2": True})
    assert proc.returncode == 2
    assert errors(proc) == ["error: plan.param_dtype: bfloat16 under SPMD FSDPv2 is torch_xla's autocast, which does "
                            "not cover scaled_dot_product_attention (it would get mixed float32/bfloat16 inputs); set "
                            "model.attn_implementation=eager, or use FSDP v1 (plan.xla_fsdp_v2=false), which casts "
                            "the parameters"]
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow
def test_the_hf_tpu_fsdp_config_trains_fsdp_v1_on_one_device_and_recommends_v2(tmp_path):
    proc = hf_tpu_run(tmp_path, HF_TPU_CONFIG, "--config.train.steps=5", nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "xla, 1 rank(s)" in proc.stdout  # --backend auto took xla from `xla: true`
    assert proc.stderr.count(RECOMMENDS_V2) == 1
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [5]


@pytest.mark.slow
def test_the_hf_tpu_fsdp_config_trains_on_spmd_fsdpv2_ignoring_v1_options(tmp_path):
    settings = {**HF_TPU_CONFIG["xla_fsdp_settings"], "shard_param_on_dim_0": True}
    proc = hf_tpu_run(tmp_path, {**HF_TPU_CONFIG, "xla_fsdp_v2": True, "xla_fsdp_settings": settings},
                      "--config.model.attn_implementation=eager", "--config.train.steps=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "xla, 2 rank(s)" in proc.stdout
    assert proc.stderr.count("plan.xla_fsdp_settings has no effect on --backend xla: {'shard_param_on_dim_0': True}: "
                             "options of torch_xla's FSDP v1") == 1
    assert RECOMMENDS_V2 not in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [5]


@pytest.mark.slow
def test_sharded_run_exports_full_weights_at_the_end(tmp_path):
    from tests.e2e.test_training_runs import _eval_loss_outside_fsdp

    workdir = tmp_path / "run"
    proc = xla_cli(workdir, "--config.plan.state_dict_type=SHARDED_STATE_DICT", "--config.train.export_full_at_end=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = workdir / "export"
    assert any(line.split() == ["export", str(export)] for line in proc.stdout.splitlines())
    files = json.loads((export / "manifest.json").read_text())["files"]
    assert "config.json" in files and not any(n.startswith(("optimizer", "rng/", "sharded/")) for n in files)
    evals = [r for r in read_metrics(workdir) if "eval_loss" in r]
    assert _eval_loss_outside_fsdp(export, {}) == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)


def test_expert_parallel_batches_that_do_not_split_over_the_devices_stop_before_anything_is_written(
        tmp_path, tmp_path_factory):
    from tests.parity import families

    mixtral = families.saved(tmp_path_factory, "mixtral")
    proc = xla_cli(tmp_path / "run", f"--config.model.init_from={mixtral}", "--config.plan.tp_size=2",
                   "--config.plan.ep_size=2", "--config.train.batch_size=1", "--config.train.eval_batch_size=1",
                   "--config.data.seq_len=63")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: plan.ep_size: expert parallelism sends each device's share of a batch's 63 tokens (rows x positions) "
        "to the experts' devices: they must divide by the 2 devices; make train.batch_size / "
        "train.grad_accum_steps x data.seq_len a multiple of 2, or set plan.ep_size=1"]
    assert not (tmp_path / "run").exists()  # nothing written
