"""The scheduler's environment as launch.cluster reads it: SLURM's hostlists and task counts, srun with one task per
node or per GPU, Kubeflow's PyTorchJob (the variables its operator sets, v1.7 on), JobSet pods, the precedence of
MASTER_ADDR / MASTER_PORT and of an Accelerate YAML, and each refusal's line."""
import os

import pytest

from portable_fsdp import run
from portable_fsdp.config import accelerate
from portable_fsdp.errors import UserError
from portable_fsdp.launch import cluster
from portable_fsdp.launch.cluster import Machines
from tests.conftest import TEST_RECIPE
from tests.unit.test_accelerate_launch import write

# What srun's job step sets (Slurm's env_array_for_step and the task's own ids).
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def slurm_step(nodes: int, tasks_per_node: int, task: int, nodelist="gpu[07-08]", job="4242", **extra) -> dict:
    """The environment of task `task` of `srun --nodes N --ntasks-per-node T` in job `job` (block distribution)."""
    return {"SLURM_JOB_ID": job, "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(nodes * tasks_per_node),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})",
            "SLURM_NTASKS": str(nodes * tasks_per_node), "SLURM_PROCID": str(task),
            "SLURM_NODEID": str(task // tasks_per_node), "SLURM_LOCALID": str(task % tasks_per_node), **extra}


def batch_script(nodes: int) -> dict:
    """The environment of an sbatch script (the batch step runs on the first node; srun has not run)."""
    step = slurm_step(nodes, 1, 0)
    return {name: value for name, value in step.items() if not name.startswith("SLURM_STEP")}


def pytorchjob_pod(replica: str, index: int, workers: int = 1, nproc: str | None = "8", name: str = "llama",
                   port: int = 23456) -> dict:
    """A pod of PyTorchJob `name` with one Master and `workers` Workers (training-operator v1.9's setPodEnv and
    MasterEnvVarGenerator: RANK is the pod's index, workers after the master; WORLD_SIZE counts processes when
    nprocPerNode is set; the master's address is its pod's service)."""
    rank = index + (replica == "worker")
    env = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
           "MASTER_ADDR": f"{name}-master-0", "PET_MASTER_ADDR": f"{name}-master-0",
           "WORLD_SIZE": str((workers + 1) * int(nproc or 1)), "RANK": str(rank), "PET_NODE_RANK": str(rank),
           "PET_NNODES": str(workers + 1)}
    return {**env, "PET_NPROC_PER_NODE": nproc} if nproc else env


def jobset_pod(index: int) -> dict:
    """A pod of examples/k8s/jobset.yaml's JobSet: JOB_COMPLETION_INDEX from Kubernetes' Indexed Job, the rest
    written by the manifest."""
    return {"JOB_COMPLETION_INDEX": str(index), "PET_NNODES": "2", "PET_NPROC_PER_NODE": "8",
            "PET_MASTER_ADDR": "llama3-8b-node-0-0.llama3-8b", "PET_MASTER_PORT": "29500"}


def refusal(call, *args) -> str:
    with pytest.raises(UserError) as caught:
        call(*args)
    return caught.value.line()


@pytest.mark.parametrize("text, hosts", [
    ("gpu07", ["gpu07"]),
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # the padding of the range's start
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),  # several groups
    ("a[3],b,c[5-6]x", ["a3", "b", "c5x", "c6x"]),
    ("10.0.0.1,10.0.0.2", ["10.0.0.1", "10.0.0.2"]),
])
def test_hostlists_expand_as_scontrol_show_hostnames(text, hosts):
    assert cluster.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, why", [("node[1-3", "unbalanced brackets"), ("node]1[", "unbalanced brackets"),
                                       ("node[3-1]", "'3-1' is not a range"), ("node[a-b]", "'a-b' is not a range")])
def test_a_broken_hostlist_is_one_line(text, why):
    assert refusal(cluster.expand_hostlist, text) == (
        f"error: SLURM_JOB_NODELIST: {text!r} is not a SLURM hostlist ({why})")


def test_tasks_per_node_expand_repeats():
    assert cluster.expand_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert refusal(cluster.expand_tasks_per_node, "8x2") == (
        "error: SLURM_TASKS_PER_NODE: '8x2' is not a tasks-per-node list such as 8(x2)")


def test_one_task_per_node_joins_the_step_nodes_at_the_first_host():
    assert cluster.scheduler_machines(slurm_step(2, 1, 1)) == Machines(
        2, 1, "gpu07", cluster.PORT_BASE + 4242, None, "SLURM_STEP_NUM_NODES")


def test_the_port_is_the_same_on_every_node_and_differs_per_job():
    ports = {job: {cluster.scheduler_machines(slurm_step(2, 1, task, job=job)).port for task in (0, 1)}
             for job in ("4242", "4243", "1234567")}
    assert ports == {"4242": {24242}, "4243": {24243}, "1234567": {24567}}


def test_master_addr_and_port_set_by_the_job_script_win():
    env = slurm_step(2, 1, 0, MASTER_ADDR="10.1.2.3", MASTER_PORT="29400")
    machines = cluster.scheduler_machines(env)
    assert (machines.address, machines.port) == ("10.1.2.3", 29400)


def test_the_step_wins_over_the_job():
    # a 4-node job whose srun uses 2 of them
    env = {**slurm_step(2, 1, 1, nodelist="gpu[03-04]"), "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4",
           "SLURM_JOB_NODELIST": "gpu[01-04]"}
    assert cluster.scheduler_machines(env) == Machines(2, 1, "gpu03", cluster.PORT_BASE + 4242, None,
                                                       "SLURM_STEP_NUM_NODES")
    assert cluster.machines_reported(env) == (2, "SLURM_STEP_NUM_NODES")


def test_one_node_or_no_scheduler_changes_nothing():
    assert cluster.scheduler_machines(slurm_step(1, 1, 0)) is None
    assert cluster.scheduler_machines(batch_script(1)) is None
    assert cluster.scheduler_machines({}) is None
    assert cluster.scheduler_machines({**slurm_step(2, 1, 0), "TORCHELASTIC_RUN_ID": "x"}) is None  # torchrun's


def test_the_batch_script_of_several_nodes_is_refused_with_the_line_to_write():
    assert refusal(cluster.scheduler_machines, batch_script(2)) == (
        "error: SLURM_JOB_NUM_NODES: 2 nodes are allocated but this command runs outside srun, on the first node "
        "only; start it with srun --ntasks-per-node=1 python -m portable_fsdp.run ...")


def test_tasks_that_do_not_divide_over_the_nodes_are_refused():
    env = {**slurm_step(2, 1, 0), "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1"}
    line = ("error: SLURM_NTASKS: 3 tasks over 2 nodes (SLURM_STEP_TASKS_PER_NODE=2,1): every node must run the same "
            "tasks; write --ntasks-per-node=1 (our launcher starts the ranks) or --ntasks-per-node=<GPUs per node>")
    assert refusal(cluster.scheduler_machines, env) == line
    assert refusal(cluster.become_rank, None, env) == line
    uneven = {**slurm_step(2, 2, 0), "SLURM_STEP_TASKS_PER_NODE": "3,1"}  # divides, but not evenly placed
    assert refusal(cluster.become_rank, None, uneven).startswith("error: SLURM_NTASKS: 4 tasks over 2 nodes (")


def test_one_task_per_gpu_becomes_a_rank_as_torchrun_would():
    env = slurm_step(2, 8, 11, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    cluster.become_rank(None, env)
    assert {name: env.get(name) for name in (*TORCHRUN, "CUDA_VISIBLE_DEVICES")} == {
        "RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(cluster.PORT_BASE + 4242), "TORCHELASTIC_RUN_ID": None,
        "CUDA_VISIBLE_DEVICES": "3"}  # the task's own GPU: device 0 of what it sees
    assert cluster.under_torchrun(env) and cluster.scheduler_machines(env) is None
    assert cluster.machines_reported(env) == (2, "SLURM_STEP_NUM_NODES")


def test_a_task_shown_its_own_gpu_keeps_it_and_the_job_script_meeting_point_wins():
    env = slurm_step(2, 8, 9, CUDA_VISIBLE_DEVICES="5", MASTER_ADDR="10.1.2.3", MASTER_PORT="29400")
    cluster.become_rank(8, env)  # --nproc equal to the tasks per node is accepted
    assert (env["CUDA_VISIBLE_DEVICES"], env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"]) == (
        "5", "10.1.2.3", "29400", "9")


def test_one_task_per_node_or_torchrun_is_left_alone():
    for env in (slurm_step(2, 1, 1), {**slurm_step(2, 8, 3), "TORCHELASTIC_RUN_ID": "x"}, batch_script(2), {}):
        before = dict(env)
        cluster.become_rank(None, env)
        assert env == before


def test_nproc_disagreeing_with_the_tasks_per_node_is_refused():
    assert refusal(cluster.become_rank, 2, slurm_step(2, 8, 0)) == (
        "error: --nproc: 2 local processes, but srun started 8 tasks per node, each one rank; drop --nproc, or start "
        "one task per node (srun --ntasks-per-node=1 python -m portable_fsdp.run ...) and let --nproc set the ranks")


@pytest.mark.parametrize("replica, index, rank", [("master", 0, 0), ("worker", 0, 1)])
def test_pytorchjob_pods_are_the_nodes(replica, index, rank):
    assert cluster.scheduler_machines(pytorchjob_pod(replica, index)) == Machines(
        2, rank, "llama-master-0", 23456, 8, "PET_NNODES")


def test_pytorchjob_without_nproc_per_node_leaves_the_processes_to_the_command():
    assert cluster.scheduler_machines(pytorchjob_pod("worker", 2, workers=3, nproc=None)) == Machines(
        4, 3, "llama-master-0", 23456, None, "PET_NNODES")
    assert cluster.scheduler_machines({**pytorchjob_pod("master", 0), "PET_NPROC_PER_NODE": "auto"}).nproc is None
    # RANK and WORLD_SIZE without LOCAL_RANK are the pod's, not torchrun's: our launcher starts the ranks
    assert not cluster.under_torchrun(pytorchjob_pod("master", 0))


def test_pytorchjob_refusals():
    elastic = {**pytorchjob_pod("worker", 0), "PET_NNODES": "1:4"}
    assert refusal(cluster.scheduler_machines, elastic) == (
        "error: PET_NNODES: '1:4': elastic node ranges are not run by portable_fsdp; give a fixed number of nodes "
        "(remove elasticPolicy's minReplicas / maxReplicas)")
    workers_only = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8"}  # no Master replica: no node rank
    assert refusal(cluster.scheduler_machines, workers_only) == (
        "error: PET_NODE_RANK: PET_NNODES=2 but this pod has no node rank; give the PyTorchJob a Master replica (the "
        "operator then sets PET_NODE_RANK), or run the pods as an Indexed Job (JOB_COMPLETION_INDEX)")
    assert refusal(cluster.scheduler_machines, {**pytorchjob_pod("worker", 0), "PET_NODE_RANK": "2"}) == (
        "error: PET_NODE_RANK: 2 is not a node rank of PET_NNODES=2")


@pytest.mark.parametrize("index", [0, 1])
def test_jobset_pods_take_their_rank_from_the_completion_index(index):
    assert cluster.scheduler_machines(jobset_pod(index)) == Machines(
        2, index, "llama3-8b-node-0-0.llama3-8b", 29500, 8, "PET_NNODES")


def test_jobset_refusals():
    assert refusal(cluster.scheduler_machines, {"JOB_COMPLETION_INDEX": "1"}) == (
        "error: PET_NNODES: this pod has JOB_COMPLETION_INDEX=1 but no node count: set PET_NNODES to the job's "
        "completions, and PET_MASTER_ADDR to its first pod's host name")
    assert cluster.scheduler_machines({"JOB_COMPLETION_INDEX": "0"}) is None  # any Indexed Job's single pod
    no_address = {name: value for name, value in jobset_pod(1).items() if name != "PET_MASTER_ADDR"}
    assert refusal(cluster.scheduler_machines, no_address) == (
        "error: PET_MASTER_ADDR: PET_NNODES=2 needs the address of node 0: set PET_MASTER_ADDR (a JobSet's first pod "
        "is <jobset>-<replicated job>-0-0.<jobset>)")


def test_the_scheduler_fills_the_launch_settings():
    nodes = accelerate.from_file(None, "cpu", None, False, cluster.scheduler_machines(jobset_pod(1)))
    assert nodes == accelerate.LaunchSettings(backend="cpu", nproc=8, num_machines=2, machine_rank=1,
                                              main_process_ip="llama3-8b-node-0-0.llama3-8b", main_process_port=29500)
    assert refusal(accelerate.from_file, None, "cpu", 4, False, cluster.scheduler_machines(jobset_pod(1))) == (
        "error: --nproc: 4 local processes, but PET_NPROC_PER_NODE=8; drop --nproc or make them agree")


def test_an_accelerate_yaml_keeps_its_meeting_point_on_the_scheduler_nodes(tmp_path):
    path = write(tmp_path, num_processes=16, num_machines=2, main_process_ip="10.9.9.9", main_process_port=29999)
    nodes = accelerate.from_file(path, "cpu", None, False, cluster.scheduler_machines(slurm_step(2, 1, 1)))
    # the node rank is SLURM's: one file on a shared disk cannot give each node its own
    assert (nodes.num_machines, nodes.machine_rank, nodes.main_process_ip, nodes.main_process_port, nodes.nproc) == (
        2, 1, "10.9.9.9", 29999, 8)


def test_an_accelerate_yaml_counting_other_machines_is_refused(tmp_path):
    path = write(tmp_path, num_machines=1)
    assert refusal(accelerate.from_file, path, "cpu", None, False, cluster.scheduler_machines(slurm_step(2, 1, 0))) \
        == (f"error: {path}: num_machines: 1, but SLURM_STEP_NUM_NODES=2; write num_machines: 2, or leave the "
            "launch keys out of the file to follow the scheduler")


@pytest.fixture
def environment():
    """os.environ as the command sees it, restored afterwards (become_rank writes torchrun's variables there)."""
    saved = dict(os.environ)
    for name in (*TORCHRUN, "CUDA_VISIBLE_DEVICES"):
        os.environ.pop(name, None)
    os.environ.update(USE_TORCH_XLA="0")
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def command_error(capsys, *args) -> tuple:
    code = run.main(["--config", TEST_RECIPE, "--backend", "cpu", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def test_the_command_refuses_a_batch_script_without_srun(environment, capsys, tmp_path):
    environment.update(batch_script(2))
    assert command_error(capsys, "--workdir", str(tmp_path / "run")) == (2, [
        "error: SLURM_JOB_NUM_NODES: 2 nodes are allocated but this command runs outside srun, on the first node "
        "only; start it with srun --ntasks-per-node=1 python -m portable_fsdp.run ..."])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("tasks_per_node", [1, 2])
def test_several_slurm_nodes_need_a_workdir(environment, capsys, tasks_per_node):
    environment.update(slurm_step(2, tasks_per_node, 0))
    assert command_error(capsys) == (2, [
        "error: --workdir: SLURM_STEP_NUM_NODES: 2 needs --workdir, one directory every machine writes to "
        "(gs://bucket/run, or a shared mount): checkpoints hold every machine's files"])


def test_a_run_in_this_process_leaves_no_rank_variables_behind(monkeypatch, tmp_path):
    """xla and flax start their one process by setting torchrun's variables; pf.train takes them back, so that a
    next pf.init (another backend) is rank 0 of 1 again rather than a half-set torchrun worker."""
    import portable_fsdp as pf
    from portable_fsdp.launch import launcher

    for name in cluster.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29999")  # one the caller set stays as it was

    def start(*args, **kwargs):
        os.environ.update(WORLD_SIZE="2", RANK="0", MASTER_PORT="1234")
        return {"steps": "done"}

    monkeypatch.setattr(launcher, "start", start)
    assert pf.train(pf.get_config("llama_tiny:test"), backend="cpu", workdir=tmp_path / "w") == {"steps": "done"}
    assert "WORLD_SIZE" not in os.environ and "RANK" not in os.environ and os.environ["MASTER_PORT"] == "29999"


def test_the_environment_is_read_at_the_call_even_after_os_environ_was_replaced(monkeypatch):
    # a library may replace os.environ after our modules were imported; a default bound at import would read the old one
    from portable_fsdp.machine import tpu_vm

    monkeypatch.setattr(os, "environ", {"TPU_WORKER_HOSTNAMES": "w-0,w-1", "TPU_WORKER_ID": "1", "WORLD_SIZE": "8",
                                        "LOCAL_WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1"})
    assert tpu_vm.slice_workers() == (1, 2)
    assert cluster.machines_reported() == (2, "torchrun")
    assert cluster.under_torchrun() and cluster.scheduler_machines() is None
