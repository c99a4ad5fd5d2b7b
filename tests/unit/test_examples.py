"""examples/slurm and examples/k8s run what they say: the command each starts parses with our own CLI, its recipe
variant exists, and the machines the scheduler would report (the variables srun, the training operator or the
JobSet manifest set) make the 2 x 8 GPUs the examples are named for."""
import re
import shlex

import pytest
import yaml

from benchmarks.common import ROOT
from portable_fsdp import run
from portable_fsdp.config import accelerate
from portable_fsdp.config.schema import apply_override, load_recipe
from portable_fsdp.configs import llama3_8b
from portable_fsdp.launch import cluster
from tests.unit.test_cluster import pytorchjob_pod, slurm_step

EXAMPLES = ROOT / "examples"
NODES, GPUS_PER_NODE = 2, 8
VARIANT = llama3_8b.VARIANTS["8xh100"]


def training_command(argv: list) -> tuple:
    """`python -m portable_fsdp.run ARGS` -> (parsed arguments, config), checked: the 8xh100 recipe on cuda, a
    workdir, resuming, and as many sequences per GPU per step as the recipe's one node."""
    assert argv[:3] == ["python", "-m", "portable_fsdp.run"]
    args, overrides = run.parse_args(argv[3:])
    recipe, _, variant = args.config.partition(":")
    assert (ROOT / recipe).is_file() and recipe.endswith("llama3_8b.py") and variant == "8xh100"
    config = load_recipe(f"{ROOT / recipe}:{variant}")
    for key, value in overrides:
        apply_override(config, key, value)
    assert args.backend == VARIANT.backend == "cuda" and args.workdir and config.train.resume
    per_gpu = VARIANT.settings["train.batch_size"] // VARIANT.nproc
    assert config.train.batch_size == per_gpu * NODES * GPUS_PER_NODE
    return args, config


def sbatch(name: str) -> tuple:
    """(#SBATCH options, the srun command's words) of examples/slurm/NAME."""
    text = (EXAMPLES / "slurm" / name).read_text()
    options = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert options["cpus-per-task"] and "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK" in text  # not one core
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()
    [srun] = [line for line in lines if line.startswith("srun ")]
    return options, shlex.split(srun)


def srun_argv(words: list) -> list:
    """The program srun runs: the words from `python` on."""
    return words[words.index("python"):]


def test_sbatch_one_task_per_node():
    options, words = sbatch("llama3_8b_2x8.sbatch")
    assert (options["nodes"], options["ntasks-per-node"], options["gpus-per-node"]) == (
        str(NODES), "1", str(GPUS_PER_NODE))
    args, _ = training_command(srun_argv(words))
    assert args.nproc is None  # each node's launcher starts one rank per GPU
    machines = cluster.scheduler_machines(slurm_step(NODES, 1, 1))
    nodes = accelerate.from_file(args.fsdp_config, args.backend, args.nproc, False, machines)
    assert (nodes.num_machines, nodes.machine_rank) == (NODES, 1)


def test_sbatch_one_task_per_gpu():
    options, words = sbatch("llama3_8b_2x8_task_per_gpu.sbatch")
    assert (options["nodes"], options["ntasks-per-node"], options["gpus-per-node"]) == (
        str(NODES), str(GPUS_PER_NODE), str(GPUS_PER_NODE))
    args, _ = training_command(srun_argv(words))
    env = slurm_step(NODES, GPUS_PER_NODE, 11, CUDA_VISIBLE_DEVICES=",".join(map(str, range(GPUS_PER_NODE))))
    cluster.become_rank(args.nproc, env)
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["RANK"], env["CUDA_VISIBLE_DEVICES"]) == (
        str(NODES * GPUS_PER_NODE), str(GPUS_PER_NODE), "11", "3")


def manifest(name: str, kind: str) -> dict:
    [document] = [d for d in yaml.safe_load_all((EXAMPLES / "k8s" / name).read_text()) if d["kind"] == kind]
    return document


def check_pod(pod: dict, container_name: str, nproc: int) -> dict:
    """The pod runs the training command with a GPU per rank, a memory-backed /dev/shm and a shared workdir;
    returns its container."""
    [container] = pod["spec"]["containers"]
    assert container["name"] == container_name
    args, _ = training_command([*container["command"], *container["args"]])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == nproc
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    workdir_mount = next(path for path in mounts if args.workdir.startswith(path + "/"))
    assert "persistentVolumeClaim" in volumes[mounts[workdir_mount]]
    return container


def test_pytorchjob():
    job = manifest("pytorchjob.yaml", "PyTorchJob")
    assert manifest("pytorchjob.yaml", "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    nproc, replicas = int(job["spec"]["nprocPerNode"]), job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"], nproc) == (1, NODES - 1, GPUS_PER_NODE)
    for spec in replicas.values():
        check_pod(spec["template"], "pytorch", nproc)  # the container the operator sets its variables in
    [port] = [p["containerPort"] for p in replicas["Master"]["template"]["spec"]["containers"][0]["ports"]
              if p["name"] == "pytorchjob-port"]  # the operator's port name: the master's becomes MASTER_PORT
    name = job["metadata"]["name"]
    for replica, rank in (("master", 0), ("worker", 1)):
        env = pytorchjob_pod(replica, 0, NODES - 1, job["spec"]["nprocPerNode"], name, port)
        assert cluster.scheduler_machines(env) == cluster.Machines(
            NODES, rank, f"{name}-master-0", port, GPUS_PER_NODE, "PET_NNODES")


@pytest.mark.parametrize("index", range(NODES))
def test_jobset(index):
    jobset = manifest("jobset.yaml", "JobSet")
    [replicated] = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    container = check_pod(job["template"], "trainer", GPUS_PER_NODE)
    env = {item["name"]: item["value"] for item in container["env"]}
    name = jobset["metadata"]["name"]
    subdomain = jobset["spec"].get("network", {}).get("subdomain", name)  # JobSet's default: its own name
    assert env["PET_MASTER_ADDR"] == f"{name}-{replicated['name']}-0-0.{subdomain}"
    assert (replicated.get("replicas", 1), job["parallelism"], job["completions"], int(env["PET_NNODES"])) == (
        1, NODES, NODES, NODES)
    assert [port["containerPort"] for port in container["ports"]] == [int(env["PET_MASTER_PORT"])]
    machines = cluster.scheduler_machines({**env, "JOB_COMPLETION_INDEX": str(index)})  # set by Kubernetes
    assert machines == cluster.Machines(NODES, index, env["PET_MASTER_ADDR"], int(env["PET_MASTER_PORT"]),
                                        GPUS_PER_NODE, "PET_NNODES")
