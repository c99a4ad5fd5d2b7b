"""Every start-up error: exit status 2, one stderr line `error: <field>: ...` naming the fix, no traceback,
no worker started. Checked in-process (fast) and, for a sample, as a real subprocess."""
import json

import pytest

from portable_fsdp import run
from tests.conftest import TEST_RECIPE, cli


def run_main(capsys, *args):
    code = run.main(["--config", TEST_RECIPE, *args])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


CASES = [
    # (arguments, field named, a phrase of the fix)
    (["--config.train.stepz=3"], "config.train.stepz", "did you mean config.train.steps"),
    (["--config.train.steps=abc"], "config.train.steps", "expects an int"),
    (["--config.train.steps"], "config.train.steps", "needs a value"),
    (["--config.plan=3"], "config.plan", "is a section"),
    (["--config.plan.reshard_after_forward=maybe"], "config.plan.reshard_after_forward", "expects a bool"),
    (["--bogus"], "command line", "unrecognised argument"),
    (["--backend", "tpu"], "command line", "invalid choice"),
    pytest.param(["--backend", "cuda"], "--backend", "use --backend cpu",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")),
    (["--backend", "xla"], "--backend", "not built yet"),
    (["--backend", "flax"], "--backend", "not built yet"),
    (["--nproc", "0"], "--nproc", "at least 1"),
    (["--config.plan.fsdp_size=3"], "plan.fsdp_size", "world size is 2"),
    (["--config.plan.fsdp_size=0"], "plan.fsdp_size", "positive integer"),
    (["--config.plan.cp_size=3"], "plan.fsdp_size", "not divisible"),
    (["--config.plan.cp_size=2", "--config.plan.sp_size=2", "--nproc", "4"], "plan.cp_size", "alternatives"),
    (["--config.plan.cp_size=2", "--config.data.seq_len=66"], "data.seq_len", "divisible by 2 x plan.cp_size = 4"),
    (["--config.plan.cp_size=2", "--config.plan.cp_impl=torch"], "plan.cp_impl", "needs CUDA"),
    (["--config.plan.cp_rotate_method=ring"], "plan.cp_rotate_method", "allgather, alltoall"),
    (["--config.plan.cp_impl=fast"], "plan.cp_impl", "auto, torch, portable"),
    (["--config.train.load_best_model_at_end=true"], "train.load_best_model_at_end", "train.eval_every > 0"),
    (["--config.train.early_stopping_patience=2"], "train.early_stopping_patience", "train.eval_every > 0"),
    (["--config.train.compute_metrics=nope:nothing"], "train.compute_metrics", "token_accuracy"),
    (["--config.plan.tp_size=2"], "plan.tp_size", "not built yet"),
    (["--config.plan.ep_size=2"], "plan.ep_size", "not built yet"),
    (["--config.plan.sp_size=2"], "plan.sp_size", "not built yet"),
    (["--config.plan.activation_checkpointing=true", "--config.train.gradient_checkpointing=true"],
     "plan.activation_checkpointing", "train.gradient_checkpointing=false"),
    (["--config.plan.transformer_layer_cls_to_wrap=GPT2Block"], "plan.transformer_layer_cls_to_wrap",
     "LlamaDecoderLayer"),
    (["--config.plan.auto_wrap_policy=SIZE_BASED_WRAP"], "plan.min_num_params", "positive min_num_params"),
    (["--config.plan.auto_wrap_policy=EVERYTHING"], "plan.auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
    (["--config.plan.state_dict_type=LOCAL_STATE_DICT"], "plan.state_dict_type", "SHARDED_STATE_DICT"),
    (["--config.plan.param_dtype=fp8"], "plan.param_dtype", "bfloat16"),
    (["--config.plan.xla_fsdp_settings=[1]"], "plan.xla_fsdp_settings", "JSON object"),
    (["--config.train.batch_size=3"], "train.batch_size", "multiple of 2"),
    (["--config.train.grad_accum_steps=3"], "train.batch_size", "multiple of 6"),
    (["--config.train.eval_batch_size=3"], "train.eval_batch_size", "multiple of 2"),
    (["--config.train.lr=0"], "train.lr", "positive"),
    (["--config.train.min_lr_ratio=2"], "train.min_lr_ratio", "[0, 1]"),
    (["--config.data.seq_len=2048"], "data.seq_len", "max_position_embeddings"),
    (["--config.data.eval_fraction=1.5"], "data.eval_fraction", "(0, 1)"),
    (["--config.model.vocab_size=100"], "model.vocab_size", ">= 257"),
    (["--config.model.num_key_value_heads=3"], "model.num_key_value_heads", "not divisible"),
    (["--config.data.source=/nonexistent/corpus.txt"], "data.source", "no such file"),
    (["--config.data.tokenizer=/nonexistent/tok"], "data.tokenizer", "local tokenizer directory"),
    (["--config.model.init_from=/nonexistent/model"], "model.init_from", "no config.json"),
    (["--config", "/nonexistent/recipe.py"], "--config", "no such recipe file"),
    (["--fsdp_config", "/nonexistent/fsdp.json"], "--fsdp_config", "no such file"),
]


def _case_id(case):
    return " ".join((case.values if hasattr(case, "values") else case)[0])


@pytest.mark.parametrize("args,field,fix", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_is_one_line_naming_the_field(capsys, tmp_path, args, field, fix):
    code, err = run_main(capsys, "--workdir", str(tmp_path / "w"), *args)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {field}: "), err[0]
    assert fix in err[0]


def test_malformed_fsdp_config(capsys, tmp_path):
    bad = tmp_path / "fsdp.json"
    bad.write_text('{"version": 2, "reshard_after_forward": tru}')
    code, err = run_main(capsys, "--workdir", str(tmp_path / "w"), "--fsdp_config", str(bad))
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: --fsdp_config: ") and "not valid JSON" in err[0]


def test_workdir_not_writable(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = run_main(capsys, "--workdir", str(blocker / "w"))
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --workdir: ")
    assert "not writable" in err[0]


def test_workdir_with_checkpoints_needs_resume(capsys, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000010\n")
    code, err = run_main(capsys, "--workdir", str(tmp_path))
    assert code == 2 and err[0].startswith("error: --workdir: ") and "resume=true" in err[0]


def test_as_a_subprocess_exit_2_and_no_traceback(tmp_path):
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path / "w"), "--config.plan.fsdp_size=5"], cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [line for line in lines if line.startswith("error: plan.fsdp_size: ")] and len(lines) == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


def test_fsdp_config_values_reach_the_plan(tmp_path):
    """A Hugging Face fsdp.json as users write it drives the run (read back from the checkpoint manifest)."""
    fsdp = tmp_path / "fsdp.json"
    fsdp.write_text(json.dumps({"version": 2, "reshard_after_forward": False, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "activation_checkpointing": True,
                                "state_dict_type": "FULL_STATE_DICT"}))
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(tmp_path / "w"), "--fsdp_config", str(fsdp),
                "--config.train.steps=2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "w" / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    assert manifest["plan"]["reshard_after_forward"] is False
    assert manifest["plan"]["activation_checkpointing"] is True
    assert manifest["plan"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
