"""An Accelerate YAML's launch keys + the command line -> LaunchSettings (portable_fsdp/config/accelerate.py)."""
import warnings

import pytest

from portable_fsdp.config.accelerate import IgnoredKey, LaunchSettings, from_file
from portable_fsdp.errors import UserError

# Verbatim as `accelerate config` writes it: TRL's examples/accelerate_configs/fsdp2.yaml.
ACCELERATE_FSDP2 = """\
# Requires accelerate 1.7.0 or higher
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def write(tmp_path, text=ACCELERATE_FSDP2, **changes):
    """The verbatim file with top-level keys replaced (value None: the key removed) or added."""
    lines = [line for line in text.splitlines() if line.partition(":")[0] not in changes]
    lines += [f"{key}: {value}" for key, value in changes.items() if value is not None]
    path = tmp_path / "accelerate.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def read(path, **cli):
    """LaunchSettings and the warnings, as 'key: why' strings."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        settings = from_file(path, **cli)
    assert all(issubclass(w.category, IgnoredKey) for w in record), [str(w.message) for w in record]
    return settings, [str(w.message).removeprefix(f"{path}: ") for w in record]


def refusal(path, **cli) -> str:
    with pytest.raises(UserError) as err:
        from_file(path, **cli)
    return err.value.line()


def test_verbatim_file_runs_num_processes_silently(tmp_path):
    settings, warned = read(write(tmp_path))
    assert settings == LaunchSettings(backend="auto", nproc=8)
    assert warned == []  # every key is honoured or at the value that asks for nothing


def test_nproc_on_the_command_line_wins(tmp_path):
    assert read(write(tmp_path), nproc=2)[0].nproc == 2
    # also where the file's total would not divide over its machines
    path = write(tmp_path, num_processes=3, num_machines=2, main_process_ip="10.0.0.4")
    assert read(path, nproc=1)[0].nproc == 1


def test_no_num_processes_leaves_the_backend_default(tmp_path):
    assert read(write(tmp_path, num_processes=None))[0].nproc is None


def test_json_or_no_file_is_the_command_line_alone(tmp_path):
    (tmp_path / "fsdp.json").write_text("{}")
    assert from_file(str(tmp_path / "fsdp.json"), "cpu", 3) == LaunchSettings(backend="cpu", nproc=3)
    assert from_file(None) == LaunchSettings()


def test_multi_node_static(tmp_path):
    path = write(tmp_path, num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.0.0.4",
                 main_process_port=5000)
    settings, warned = read(path)
    assert settings == LaunchSettings(backend="auto", nproc=4, num_machines=2, machine_rank=1,
                                      main_process_ip="10.0.0.4", main_process_port=5000, rdzv_backend="static")
    assert settings.multi_node and warned == []


def test_multi_node_flax(tmp_path):
    """flax: each machine's launcher is one JAX process, machine_rank of num_machines, driving nproc devices."""
    path = write(tmp_path, num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.0.0.4")
    settings, warned = read(path, backend="flax")
    assert settings == LaunchSettings(backend="flax", nproc=4, num_machines=2, machine_rank=1,
                                      main_process_ip="10.0.0.4", main_process_port=29500, rdzv_backend="static")
    assert warned == []


def test_multi_node_default_port_and_c10d(tmp_path):
    path = write(tmp_path, num_machines=2, machine_rank=1, main_process_ip="10.0.0.4", rdzv_backend="c10d")
    settings, warned = read(path)
    assert (settings.main_process_port, settings.rdzv_backend, settings.nproc) == (29500, "c10d", 4)
    assert warned == ["machine_rank is ignored: with rdzv_backend c10d the rendezvous assigns node ranks "
                      "(write static to keep it)"]


@pytest.mark.parametrize("changes, backend, expected", [
    ({"use_cpu": "true"}, "auto", "cpu"),
    ({"distributed_type": "MULTI_CPU"}, "auto", "cpu"),
    ({"distributed_type": "MULTI_GPU"}, "auto", "auto"),
    ({"distributed_type": "XLA"}, "auto", "xla"),
    ({"distributed_type": "NO"}, "auto", "auto"),
    ({"distributed_type": "FSDP"}, "flax", "flax"),
])
def test_backend(tmp_path, changes, backend, expected):
    settings, warned = read(write(tmp_path, **changes), backend=backend)
    assert settings.backend == expected and warned == []


@pytest.mark.parametrize("changes, backend, line", [
    ({"use_cpu": "true"}, "cuda", "use_cpu is ignored: --backend cuda on the command line wins"),
    ({"distributed_type": "XLA"}, "cpu", "distributed_type is ignored: --backend cpu on the command line wins"),
])
def test_command_line_backend_wins(tmp_path, changes, backend, line):
    settings, warned = read(write(tmp_path, **changes), backend=backend)
    assert settings.backend == backend and warned == [line]


# Each key this launcher does not act on, at a value that asks for something: exactly one warning line.
IGNORED = [
    ("debug", "true", "debug is ignored: portable_fsdp has no debug launch mode; set TORCH_DISTRIBUTED_DEBUG=DETAIL "
                      "for torch's checks"),
    ("downcast_bf16", "'yes'", "downcast_bf16 is ignored: a torch_xla bf16 downcast of Accelerate's; set "
                               "mixed_precision or plan.param_dtype"),
    ("enable_cpu_affinity", "true", "enable_cpu_affinity is ignored: workers are not pinned to CPU cores by this "
                                    "launcher"),
    ("same_network", "false", "same_network is ignored: the rendezvous only needs main_process_ip:main_process_port "
                              "reachable from every machine"),
    ("main_training_function", "train", "main_training_function is ignored: the command trains the recipe given by "
                                        "--config; there is no function to call"),
    ("gpu_ids", "0,1", "gpu_ids is ignored: this launcher does not restrict devices (untested without GPUs); run "
                       "the command with CUDA_VISIBLE_DEVICES set instead"),
    ("tpu_name", "my-pod", "tpu_name is ignored: Accelerate's TPU-pod launcher setting; start the command on each "
                           "TPU host yourself"),
    ("tpu_env", "[FOO=1]", "tpu_env is ignored: Accelerate's TPU-pod launcher setting; start the command on each "
                           "TPU host yourself"),
    ("tpu_use_sudo", "true", "tpu_use_sudo is ignored: Accelerate's TPU-pod launcher setting; start the command on "
                             "each TPU host yourself"),
    ("deepspeed_config", "{zero_stage: 3}", "deepspeed_config is ignored: a section portable_fsdp does not read"),
    ("dynamo_config", "{dynamo_backend: INDUCTOR}", "dynamo_config is ignored: a section portable_fsdp does not read"),
    ("main_process_ip", "10.0.0.4", "main_process_ip is ignored: with num_machines: 1 the workers meet on 127.0.0.1"),
    ("my_own_key", "1", "my_own_key is ignored: not an Accelerate setting portable_fsdp knows"),
]


@pytest.mark.parametrize("key, value, line", IGNORED, ids=[case[0] for case in IGNORED])
def test_ignored_key_warns_once(tmp_path, key, value, line):
    settings, warned = read(write(tmp_path, **{key: value}))
    assert warned == [line]
    assert settings.nproc == 8


@pytest.mark.parametrize("key, value", [("gpu_ids", "all"), ("deepspeed_config", "{}"), ("debug", "false"),
                                        ("downcast_bf16", "no"), ("main_process_ip", "null")])
def test_values_that_ask_nothing_are_silent(tmp_path, key, value):
    assert read(write(tmp_path, **{key: value}))[1] == []


def test_under_torchrun_the_launch_keys_are_one_warning(tmp_path):
    path = write(tmp_path, num_processes=8, num_machines=2, main_process_ip="10.0.0.4", main_process_port=5000)
    settings, warned = read(path, nproc=None, torchrun=True)
    assert settings == LaunchSettings(backend="auto", nproc=None)
    assert warned == ["num_processes, num_machines, machine_rank, main_process_ip, main_process_port, rdzv_backend "
                      "is ignored: torchrun decides the processes and the rendezvous"]


# (changes, command line, the exact error line without the path prefix)
REFUSED = [
    ({"num_processes": 3, "num_machines": 2, "main_process_ip": "10.0.0.4"}, {},
     "num_processes: 3 processes do not divide over num_machines = 2 (Accelerate counts the processes of all "
     "machines); set num_processes to a multiple of num_machines"),
    ({"distributed_type": "DEEPSPEED"}, {},
     "distributed_type: DEEPSPEED is not run by portable_fsdp; write distributed_type: FSDP (with the fsdp_config "
     "section), or XLA for torch_xla"),
    ({"distributed_type": "MEGATRON_LM"}, {},
     "distributed_type: MEGATRON_LM is not run by portable_fsdp; write distributed_type: FSDP (with the fsdp_config "
     "section), or XLA for torch_xla"),
    ({"num_machines": 2, "main_process_ip": "10.0.0.4", "rdzv_backend": "c10d"}, {"backend": "flax"},
     "rdzv_backend: c10d: --backend flax joins jax.distributed with machine_rank as the process id, which c10d "
     "does not keep; write rdzv_backend: static"),
    ({"num_machines": 2, "main_process_ip": "10.0.0.4", "distributed_type": "XLA"}, {},
     "num_machines: = 2: --backend xla runs several machines only as the hosts of one TPU slice, and this host is "
     "not in one; set num_machines: 1"),
    ({"num_machines": 2}, {},
     "main_process_ip: num_machines: 2 needs main_process_ip, the address of the machine with machine_rank 0"),
    ({"num_machines": 2, "machine_rank": 2, "main_process_ip": "10.0.0.4"}, {},
     "machine_rank: must be an integer from 0 to num_machines - 1 = 1 (got 2)"),
    ({"num_processes": 0}, {}, "num_processes: must be a positive integer (got 0)"),
    ({"num_machines": "two"}, {}, "num_machines: must be a positive integer (got 'two')"),
    ({"main_process_port": "http"}, {}, "main_process_port: must be a port number (got 'http')"),
    ({"rdzv_backend": "etcd"}, {}, "rdzv_backend: 'etcd' is not supported; choose static (Accelerate's default) or c10d"),
    ({"use_cpu": "maybe"}, {}, "use_cpu: must be true or false (got 'maybe')"),
    ({"compute_environment": "AMAZON_SAGEMAKER"}, {},
     "compute_environment: AMAZON_SAGEMAKER is not launched by portable_fsdp; write compute_environment: "
     "LOCAL_MACHINE and start the command on each machine"),
]


@pytest.mark.parametrize("changes, cli, message", REFUSED, ids=[m.partition(":")[0] + str(i)
                                                                for i, (_, _, m) in enumerate(REFUSED)])
def test_refused(tmp_path, changes, cli, message):
    path = write(tmp_path, **changes)
    assert refusal(path, **cli) == f"error: {path}: {message}"
