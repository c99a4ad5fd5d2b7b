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


# (arguments, the exact stderr line). Every case: exit status 2, that one line, no worker started.
CASES = [
    (['--config.train.stepz=3'],
     'error: config.train.stepz: unknown field; did you mean config.train.steps?'),
    (['--config.train.steps=abc'],
     "error: config.train.steps: expects an int, got 'abc'"),
    (['--config.train.steps'],
     'error: config.train.steps: needs a value: write --config.a.b=value'),
    (['--config.plan=3'],
     'error: config.plan: is a section; set one of its fields, e.g. --config.plan.activation_checkpointing=...'),
    (['--config.plan.reshard_after_forward=maybe'],
     "error: config.plan.reshard_after_forward: expects a bool, got 'maybe'"),
    (['--bogus'],
     "error: command line: unrecognised argument '--bogus'; fields are set as --config.a.b=value"),
    (['--backend', 'tpu'],
     "error: command line: argument --backend: invalid choice: 'tpu' (choose from 'auto', 'cpu', 'cuda', 'xla', 'flax')"),
    pytest.param(['--backend', 'cuda'],
                 'error: --backend: cuda was asked for but no GPU is visible; use --backend cpu',
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")),
    (['--nproc', '0'],
     'error: --nproc: must be at least 1 (got 0)'),
    (['--config.plan.fsdp_size=3'],
     'error: plan.fsdp_size: mesh dp_replicate*fsdp*cp*sp*tp = 1*3*1*1*1 = 3 but the world size is 2; set plan.fsdp_size=-1 to infer it or change --nproc'),
    (['--config.plan.tp_size=2', '--config.plan.dp_replicate_size=2'],
     'error: plan.fsdp_size: cannot infer: world size 2 is not divisible by dp_replicate*cp*sp*tp = 4; change the mesh sizes or --nproc'),
    (['--config.plan.fsdp_size=0'],
     'error: plan.fsdp_size: must be a positive integer (got 0)'),
    (['--config.plan.cp_size=3'],
     'error: plan.fsdp_size: cannot infer: world size 2 is not divisible by dp_replicate*cp*sp*tp = 3; change the mesh sizes or --nproc'),
    (['--config.plan.cp_size=2', '--config.plan.sp_size=2', '--nproc', '4'],
     'error: plan.cp_size: context parallelism (cp_size=2) and Ulysses sequence parallelism (sp_size=2) are alternatives; set one of them to 1'),
    (['--config.plan.cp_size=2', '--config.data.seq_len=66'],
     'error: data.seq_len: 66 must be divisible by 2 x plan.cp_size = 4 (cp_size=2) so each rank gets equal head and tail chunks; use e.g. data.seq_len=64'),
    (['--config.plan.cp_size=2', '--config.plan.cp_impl=torch'],
     "error: plan.cp_impl: torch's context_parallel needs CUDA SDPA kernels and cannot run on cpu; use plan.cp_impl=portable (or auto)"),
    (['--config.plan.cp_rotate_method=ring'],
     "error: plan.cp_rotate_method: unknown value 'ring'; choose one of allgather, alltoall"),
    (['--config.plan.cp_impl=fast'],
     "error: plan.cp_impl: unknown value 'fast'; choose one of auto, torch, portable"),
    (['--config.train.loss_chunk_tokens=-1'],
     'error: train.loss_chunk_tokens: must be >= 0 (got -1)'),
    (['--config.train.load_best_model_at_end=true'],
     'error: train.load_best_model_at_end: needs evaluations during training: set train.eval_every > 0'),
    (['--config.train.early_stopping_patience=2'],
     'error: train.early_stopping_patience: needs evaluations during training: set train.eval_every > 0'),
    (['--config.train.compute_metrics=nope:nothing'],
     "error: train.compute_metrics: cannot import 'nope:nothing'; use one of token_accuracy or 'package.module:function'"),
    (['--config.train.report_to=tensorboard,mlflow'],
     "error: train.report_to: unknown tracker 'mlflow'; choose none, all, tensorboard, wandb or tensorboard,wandb"),
    (['--config.plan.ep_size=2'],
     'error: plan.ep_size: 2 needs a mixture-of-experts model; LlamaForCausalLM is dense (no experts to split): set plan.ep_size=1'),
    (['--config.plan.tp_size=4', '--nproc', '4'],
     "error: plan.tp_size: the model's 2 key/value heads are not divisible by tp_size=4 (tensor parallelism splits heads over tp ranks); use e.g. plan.tp_size=2"),
    (['--config.plan.sp_size=4', '--nproc', '4'],
     "error: plan.sp_size: the model's 2 key/value heads are not divisible by sp_size=4 (Ulysses sequence parallelism gives each sp rank whole heads around attention); use e.g. plan.sp_size=2"),
    (['--config.plan.sp_size=2', '--config.data.seq_len=63'],
     'error: data.seq_len: 63 must be divisible by plan.sp_size=2 so each rank gets an equal slice; use e.g. data.seq_len=62'),
    (['--config.plan.tp_size=2', '--config.plan.tp_plan={"layers.*.mlp.up_proj": "sideways"}'],
     "error: plan.tp_plan: unknown style 'sideways'; choose one of colwise, rowwise, packed_colwise, replicated_with_grad_allreduce, moe_tp_experts"),
    (['--config.plan.activation_checkpointing=true', '--config.train.gradient_checkpointing=true'],
     'error: plan.activation_checkpointing: is on together with train.gradient_checkpointing; they recompute the same activations twice: keep plan.activation_checkpointing and set train.gradient_checkpointing=false'),
    (['--config.plan.transformer_layer_cls_to_wrap=GPT2Block'],
     'error: plan.transformer_layer_cls_to_wrap: the model has no class GPT2Block; classes it has: LlamaDecoderLayer'),
    (['--config.plan.transformer_layer_cls_to_wrap=LlamaForCausalLM'],
     'error: plan.transformer_layer_cls_to_wrap: LlamaForCausalLM is the whole model: one unit gathers every parameter '
     'at once and saves no memory; wrap its layers instead (classes it has: LlamaDecoderLayer), or set '
     'plan.auto_wrap_policy=NO_WRAP'),
    (['--config.plan.transformer_layer_cls_to_wrap=LlamaDecoderLayer,LlamaMLP'],
     'error: plan.transformer_layer_cls_to_wrap: LlamaDecoderLayer contains LlamaMLP: a unit inside another unit is '
     'gathered twice; name one of them (classes it has: LlamaDecoderLayer)'),
    (['--fsdp', 'hybrid_shard full_shard'],
     'error: --fsdp: names two sharding strategies (hybrid_shard and full_shard); keep one'),
    (['--config.plan.auto_wrap_policy=SIZE_BASED_WRAP'],
     'error: plan.min_num_params: SIZE_BASED_WRAP needs a positive min_num_params (e.g. 100000000); set plan.min_num_params or choose another plan.auto_wrap_policy'),
    (['--config.plan.auto_wrap_policy=EVERYTHING'],
     "error: plan.auto_wrap_policy: unknown value 'EVERYTHING'; choose one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP"),
    (['--config.plan.state_dict_type=LOCAL_STATE_DICT'],
     "error: plan.state_dict_type: unknown value 'LOCAL_STATE_DICT'; choose one of FULL_STATE_DICT, SHARDED_STATE_DICT"),
    (['--config.plan.param_dtype=float16'],
     'error: plan.param_dtype: float16 trains only with loss scaling (gradients below float16\'s range become 0), which '
     'this lowering does not apply; use bfloat16 (Accelerate: mixed_precision: bf16), which needs none'),
    (['--config.plan.param_dtype=fp8'],
     "error: plan.param_dtype: unknown dtype 'fp8'; choose one of float32, bfloat16, float16"),
    (['--config.plan.xla_fsdp_settings=[1]'],
     'error: config.plan.xla_fsdp_settings: must be a JSON object such as {"compute_dtype": "bfloat16"}'),
    (['--config.train.batch_size=3'],
     'error: train.batch_size: 3 sequences do not split over 2 data-parallel ranks x 1 accumulation steps; make it a multiple of 2'),
    (['--config.train.grad_accum_steps=3'],
     'error: train.batch_size: 4 sequences do not split over 2 data-parallel ranks x 3 accumulation steps; make it a multiple of 6'),
    (['--config.train.eval_batch_size=3'],
     'error: train.eval_batch_size: 3 does not split over 2 data-parallel ranks; make it a multiple of 2'),
    (['--config.train.lr=0'],
     'error: train.lr: must be positive (got 0.0)'),
    (['--config.train.min_lr_ratio=2'],
     'error: train.min_lr_ratio: must be in [0, 1] (got 2.0)'),
    (['--config.data.seq_len=2048'],
     'error: data.seq_len: 2048 exceeds model.max_position_embeddings=1024; shorten data.seq_len or raise model.max_position_embeddings'),
    (['--config.data.eval_fraction=1.5'],
     'error: data.eval_fraction: must be in (0, 1) (got 1.5)'),
    (['--config.model.vocab_size=100'],
     "error: model.vocab_size: 100 is smaller than the tokenizer's 257 ids; token ids would index past the embedding: set model.vocab_size >= 257"),
    (['--config.model.num_key_value_heads=3'],
     'error: model.num_key_value_heads: 4 attention heads are not divisible by 3 kv heads'),
    (['--config.data.source=/nonexistent/corpus.txt'],
     "error: data.source: no such file or directory /nonexistent/corpus.txt; use 'bundled' or a local path"),
    (['--config.data.tokenizer=/nonexistent/tok'],
     "error: data.tokenizer: must be 'byte', a local tokenizer directory or a hub id org/name (no directory "
     "/nonexistent/tok)"),
    (['--config.model.init_from=/nonexistent/model'],
     'error: model.init_from: /nonexistent/model is not a local model directory (no config.json) or a hub id (org/name)'),
    (['--config', '/nonexistent/recipe.py'],
     'error: --config: no such recipe file /nonexistent/recipe.py; give a path like portable_fsdp/configs/llama_tiny.py'),
    (['--fsdp_config', '/nonexistent/fsdp.json'],
     'error: --fsdp_config: no such file /nonexistent/fsdp.json'),
]


def _case_id(case):
    return " ".join((case.values if hasattr(case, "values") else case)[0])


@pytest.mark.parametrize("args,expected", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_is_one_exact_line(capsys, tmp_path, args, expected):
    code, err = run_main(capsys, "--workdir", str(tmp_path / "w"), *args)
    assert code == 2
    assert err == [expected]
    assert not any((tmp_path / "w").rglob("*")), "a refused run wrote into its workdir"


def test_master_port_in_use(capsys, tmp_path, monkeypatch):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        code, err = run_main(capsys, "--workdir", str(tmp_path / "w"))
    assert code == 2
    assert err == [f"error: MASTER_PORT: port {port} is already in use; unset MASTER_PORT to take a free port, "
                   "or give another"]


def test_empty_dataset(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = run_main(capsys, "--workdir", str(tmp_path / "w"), f"--config.data.source={empty}")
    assert code == 2
    assert err == [f"error: data.source: {empty} gives 0 tokens = 0 sequences of data.seq_len=64, too few for 1 eval "
                   "sequences and one global batch of 4; use more text or a shorter data.seq_len"]


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


@pytest.mark.slow  # a training run; tests/unit/test_hf_import.py maps every field, test_accelerate_yaml.py runs one
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


def test_wrapping_single_layers_warns_once_at_start_up(tmp_path):
    """`transformer_layer_cls_to_wrap: Linear` runs, with one warning about its communication, from the
    launcher (not once per rank)."""
    from portable_fsdp.launch import launcher as launch
    from portable_fsdp.config.schema import apply_override, load_recipe

    config = load_recipe(TEST_RECIPE)
    apply_override(config, "plan.transformer_layer_cls_to_wrap", "Linear")
    with pytest.warns(UserWarning, match="Linear holds no other module, so every Linear becomes its own FSDP unit"):
        plan = launch.preflight(config, "cpu", 2, tmp_path / "w")
    assert plan.transformer_layer_cls_to_wrap == ("Linear",)


def test_several_machines_are_refused_when_auto_resolves_to_xla(capsys, tmp_path):
    """`xla: true` in the file makes --backend auto take xla only after the launch keys were read: several
    machines are refused there too, not run as separate single-host jobs."""
    yaml = tmp_path / "tpu.yaml"
    yaml.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                    "  xla: true\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\nmain_process_port: 29555\n"
                    "num_machines: 2\nnum_processes: 2\n")
    code, err = run_main(capsys, "--fsdp_config", str(yaml), "--workdir", str(tmp_path / "w"))
    assert code == 2
    assert err[-1] == (f"error: {yaml}: num_machines: = 2: --backend xla runs several machines only as the hosts of "
                       "one TPU slice, and this host is not in one; set num_machines: 1")
    assert not (tmp_path / "w").exists()


def test_warnings_are_one_line_each_with_no_python_source_line(tmp_path):
    """What runs but not as asked (a capability warning, an ignored flag, an FSDP1 file) is one `warning:` line
    on stderr, not Python's `file:line: UserWarning` and the source line under it."""
    fsdp = tmp_path / "fsdp.json"
    fsdp.write_text(json.dumps({"version": 1, "use_orig_params": True}))
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    proc = cli(["--config", TEST_RECIPE, "--workdir", str(not_a_directory), "--fsdp_config", str(fsdp),
                "--parallelism_config_cp_size", "2", "--config.plan.transformer_layer_cls_to_wrap=Linear"], cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: --workdir"), proc.stderr
    warned = lines[:-1]
    assert all(line.startswith("warning: ") for line in warned), warned
    assert [line.split(":")[1].strip() for line in warned if "fsdp.json" in line] == [str(fsdp)] * 2
    assert any("--parallelism_config_cp_size is ignored" in line for line in warned)
    assert any("Linear holds no other module" in line for line in warned)
