"""The machines a scheduler started this command on, read once from the environment it sets.

- SLURM, one task per node (`srun --ntasks-per-node=1 python -m portable_fsdp.run ...`): every node's launcher
  starts its local ranks and joins the others at the first host of the step's nodelist (`Machines`).
- SLURM, one task per GPU (`srun --ntasks-per-node=8 ...`): each task is one rank, as torchrun would start it
  (`become_rank` sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and shows the task
  its own GPU).
- Kubeflow's PyTorchJob and TrainJob: every pod gets torchrun's PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
  PET_MASTER_ADDR and PET_MASTER_PORT (the pod is one node).
- JobSet: an Indexed Job's pods carry JOB_COMPLETION_INDEX (the node rank); the manifest writes PET_NNODES and
  PET_MASTER_ADDR (the first pod's name under the JobSet's headless service), as Kubeflow's TrainJob does.

MASTER_ADDR / MASTER_PORT win over what the scheduler implies, so a job script that sets them is obeyed. Nothing here
imports a framework: the launcher and the command read it before any worker starts."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re

from portable_fsdp.errors import UserError

# Every node derives the same port from the job's id: they cannot agree on a free one without talking.
PORT_BASE, PORT_SPAN = 20000, 10000
# What runs the command, for the lines that name the fix.
SRUN_LINE = "srun --ntasks-per-node=1 python -m portable_fsdp.run ..."


@dataclasses.dataclass(frozen=True)
class Machines:
    """What a scheduler says about the machines of one run: `count` machines, this one `rank`, meeting at
    `address:port`; `nproc`: local ranks per machine when the scheduler says (None: the command's default).
    `count_variable` names where the count came from, for messages."""

    count: int
    rank: int
    address: str
    port: int
    nproc: int | None
    count_variable: str


# torchrun's variables: what makes a process one rank of a run.
# The functions below read `environ` (tests pass their own), else os.environ as it is at the call: never a default
# bound at import, which a library replacing os.environ later (a worker pool's set-up does) would leave stale.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def rank_environment(**variables):
    """torchrun's variables as they are (and `variables` set), taken back afterwards: a caller of the Python API
    that trains in this process and then again (another backend, another world size) must not look like a
    torchrun worker, nor one of the world before."""
    saved = {name: os.environ.get(name) for name in {*RANK_VARIABLES, *variables}}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def under_torchrun(environ=None) -> bool:
    """Whether torchrun (or a scheduler acting as it, see `become_rank`) made this process one rank."""
    environ = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in environ or all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed hostlist -> host names, in order: `node[01-03,07],gpu-a[1-2]` -> node01 node02 node03
    node07 gpu-a1 gpu-a2. A range keeps its zero padding; a name may hold several bracket groups (`r[1-2]n[1-2]`:
    every combination, the last group fastest)."""
    hosts = []
    for name in _split_outside_brackets(text.strip()):
        expansions = [""]
        for literal, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            choices = _expand_group(group, text) if group else [""]
            expansions = [f"{done}{literal}{choice}" for done in expansions for choice in choices]
        hosts.extend(expansions)
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    names, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if depth not in (0, 1):
            raise UserError("SLURM_JOB_NODELIST", f"{text!r} is not a SLURM hostlist (unbalanced brackets)")
        if char == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise UserError("SLURM_JOB_NODELIST", f"{text!r} is not a SLURM hostlist (unbalanced brackets)")
    return [name for name in [*names, current] if name]


def _expand_group(group: str, text: str) -> list[str]:
    """`01-03,07` -> 01 02 03 07."""
    values = []
    for part in group.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise UserError("SLURM_JOB_NODELIST", f"{text!r} is not a SLURM hostlist ({part!r} is not a range)")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1))
    return values


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks-per-node list -> one count per node: `8(x2),4` -> 8 8 4."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise UserError("SLURM_TASKS_PER_NODE", f"{text!r} is not a tasks-per-node list such as 8(x2)")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def machines_reported(environ=None) -> tuple | None:
    """(machines, the variable that says so) for a run started by srun (the step's nodes), by torchrun (its world
    over its local world), in a SLURM job (its nodes) or by a Kubernetes operator (PET_NNODES); None when none
    reports."""
    environ = os.environ if environ is None else environ
    if environ.get("SLURM_STEP_NUM_NODES", "").isdigit():
        return int(environ["SLURM_STEP_NUM_NODES"]), "SLURM_STEP_NUM_NODES"
    if environ.get("WORLD_SIZE", "").isdigit() and environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(environ["WORLD_SIZE"]) // max(1, int(environ["LOCAL_WORLD_SIZE"]))), "torchrun"
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "PET_NNODES"):
        if environ.get(name, "").isdigit():
            return int(environ[name]), name
    return None


def become_rank(nproc: int | None, environ=None) -> None:
    """Under an `srun` with one task per GPU (more tasks than nodes), make this task one rank as torchrun would:
    RANK = SLURM_PROCID, LOCAL_RANK = SLURM_LOCALID, WORLD_SIZE = the step's tasks, LOCAL_WORLD_SIZE = its tasks
    per node, MASTER_ADDR / MASTER_PORT as `slurm_machines` finds them; a CUDA_VISIBLE_DEVICES listing several
    GPUs keeps the task's own. Nothing under torchrun or outside such a step. `nproc`: the command's --nproc,
    which must then equal the tasks per node."""
    environ = os.environ if environ is None else environ
    if under_torchrun(environ) or not _in_srun_step(environ):
        return
    nodes, tasks = _step_size(environ)
    if tasks == nodes:
        return
    per_node = _tasks_per_node(environ, nodes, tasks)
    if nproc is not None and nproc != per_node:
        raise UserError("--nproc", (
            f"{nproc} local processes, but srun started {per_node} tasks per node, each one rank; drop --nproc, or "
            f"start one task per node ({SRUN_LINE}) and let --nproc set the ranks"))
    local_rank = _int(environ, "SLURM_LOCALID")
    address, port = _meeting_point(environ)
    environ.update(RANK=str(_int(environ, "SLURM_PROCID")), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(tasks),
                   LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR=address, MASTER_PORT=str(port))
    gpus = [gpu for gpu in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if gpu.strip()]
    if len(gpus) > 1 and local_rank < len(gpus):  # srun showed every task all the node's GPUs
        environ["CUDA_VISIBLE_DEVICES"] = gpus[local_rank]


def scheduler_machines(environ=None) -> Machines | None:
    """The machines SLURM (one task per node) or a Kubernetes operator reports; None under torchrun, outside a
    scheduler, or when it started this command on one machine."""
    environ = os.environ if environ is None else environ
    if under_torchrun(environ):
        return None
    machines = slurm_machines(environ) if "SLURM_JOB_ID" in environ else kubernetes_machines(environ)
    return machines if machines and machines.count > 1 else None


def joined(nodes, machines: Machines | None, file_machines: int | None = None, path: str = ""):
    """`nodes` (the command line's and an Accelerate YAML's LaunchSettings) on the scheduler's `machines`. A file
    that writes num_machines (`file_machines`, read from `path`) keeps its meeting point and rendezvous but must
    count the same machines; the node rank is the scheduler's either way (one file on a shared disk cannot give
    each node its own). --nproc must agree with the processes per node the scheduler states."""
    if machines is None:
        return nodes
    if nodes.nproc is not None and machines.nproc is not None and nodes.nproc != machines.nproc:
        raise UserError("--nproc", (
            f"{nodes.nproc} local processes, but PET_NPROC_PER_NODE={machines.nproc}; drop --nproc or make them "
            "agree"))
    nproc = machines.nproc if nodes.nproc is None else nodes.nproc
    if file_machines is not None:
        if file_machines != machines.count:
            raise UserError(f"{path}: num_machines", (
                f"{file_machines}, but {machines.count_variable}={machines.count}; write num_machines: "
                f"{machines.count}, or leave the launch keys out of the file to follow the scheduler"))
        return dataclasses.replace(nodes, machine_rank=machines.rank, nproc=nproc)
    return dataclasses.replace(nodes, nproc=nproc, num_machines=machines.count, machine_rank=machines.rank,
                               main_process_ip=machines.address, main_process_port=machines.port,
                               rdzv_backend="static")


def slurm_machines(environ=None) -> Machines | None:
    """One task per node of an srun step: the step's nodes (SLURM_STEP_NUM_NODES), this one SLURM_NODEID, meeting
    at the first host of SLURM_STEP_NODELIST. Outside srun on several nodes: refused, only the first would run."""
    environ = os.environ if environ is None else environ
    if not _in_srun_step(environ):
        allocated = _int(environ, "SLURM_JOB_NUM_NODES", _int(environ, "SLURM_NNODES", 1))
        if allocated > 1:
            raise UserError("SLURM_JOB_NUM_NODES", (
                f"{allocated} nodes are allocated but this command runs outside srun, on the first node only; "
                f"start it with {SRUN_LINE}"))
        return None
    nodes, tasks = _step_size(environ)
    _tasks_per_node(environ, nodes, tasks)  # uneven tasks are refused here too
    address, port = _meeting_point(environ)
    return Machines(nodes, _int(environ, "SLURM_NODEID", 0), address, port, None, "SLURM_STEP_NUM_NODES")


def kubernetes_machines(environ=None) -> Machines | None:
    """A pod of a PyTorchJob / TrainJob (PET_* variables) or of a JobSet (JOB_COMPLETION_INDEX, with PET_NNODES
    and PET_MASTER_ADDR written by the manifest); None outside them."""
    environ = os.environ if environ is None else environ
    if "PET_NNODES" not in environ:
        if _int(environ, "JOB_COMPLETION_INDEX", 0) > 0:
            raise UserError("PET_NNODES", (
                f"this pod has JOB_COMPLETION_INDEX={environ['JOB_COMPLETION_INDEX']} but no node count: set "
                "PET_NNODES to the job's completions, and PET_MASTER_ADDR to its first pod's host name"))
        return None
    count_text = environ["PET_NNODES"]
    if not count_text.isdigit():
        raise UserError("PET_NNODES", (
            f"{count_text!r}: elastic node ranges are not run by portable_fsdp; give a fixed number of nodes (remove "
            "elasticPolicy's minReplicas / maxReplicas)"))
    count = int(count_text)
    rank_variable = next((name for name in ("PET_NODE_RANK", "JOB_COMPLETION_INDEX") if name in environ), None)
    if count > 1 and rank_variable is None:
        raise UserError("PET_NODE_RANK", (
            f"PET_NNODES={count} but this pod has no node rank; give the PyTorchJob a Master replica (the operator "
            "then sets PET_NODE_RANK), or run the pods as an Indexed Job (JOB_COMPLETION_INDEX)"))
    rank = _int(environ, rank_variable, 0) if rank_variable else 0
    if not 0 <= rank < count:
        raise UserError(rank_variable, f"{rank} is not a node rank of PET_NNODES={count}")
    address = environ.get("MASTER_ADDR") or environ.get("PET_MASTER_ADDR")
    if count > 1 and not address:
        raise UserError("PET_MASTER_ADDR", (
            f"PET_NNODES={count} needs the address of node 0: set PET_MASTER_ADDR (a JobSet's first pod is "
            "<jobset>-<replicated job>-0-0.<jobset>)"))
    port = _int(environ, "MASTER_PORT", _int(environ, "PET_MASTER_PORT", 29500))  # torchrun's default
    nproc_text = environ.get("PET_NPROC_PER_NODE", "auto")
    nproc = int(nproc_text) if nproc_text.isdigit() else None  # auto, gpu, cpu: the backend's default
    return Machines(count, rank, address or "127.0.0.1", port, nproc, "PET_NNODES")


def _in_srun_step(environ) -> bool:
    """Inside `srun` (a job step), not the batch script: srun sets the step's variables."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_NUM_NODES" in environ


def _step_size(environ) -> tuple[int, int]:
    """(nodes, tasks) of the srun step, else of the job."""
    nodes = _int(environ, "SLURM_STEP_NUM_NODES")
    return nodes, _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", nodes))


def _tasks_per_node(environ, nodes: int, tasks: int) -> int:
    """The tasks every node runs; refused unless they are the same on every node."""
    name = next((name for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                 if name in environ), None)
    per_node = set(expand_tasks_per_node(environ[name])) if name else set()
    if tasks % nodes or len(per_node) > 1:
        shown = f" ({name}={environ[name]})" if name else ""
        raise UserError("SLURM_NTASKS", (
            f"{tasks} tasks over {nodes} nodes{shown}: every node must run the same tasks; write "
            "--ntasks-per-node=1 (our launcher starts the ranks) or --ntasks-per-node=<GPUs per node>"))
    return tasks // nodes


def _meeting_point(environ) -> tuple[str, int]:
    """Where the ranks meet: MASTER_ADDR / MASTER_PORT when the job script sets them, else the first host of the
    step's nodelist and a port derived from the job's id (the same on every node)."""
    address = environ.get("MASTER_ADDR")
    if not address:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise UserError("MASTER_ADDR", "SLURM gives no nodelist; set MASTER_ADDR to the first node's address")
        address = expand_hostlist(nodelist)[0]
    job = re.sub(r"\D", "", environ["SLURM_JOB_ID"]) or "0"
    return address, _int(environ, "MASTER_PORT", PORT_BASE + int(job) % PORT_SPAN)


def _int(environ, name: str, default: int | None = None) -> int:
    """The whole number `name` holds; `default` when it is unset (required when None)."""
    text = environ.get(name)
    if text is None and default is not None:
        return default
    if text is None or not text.strip().isdigit():
        raise UserError(name, f"{text!r} is not a whole number; unset it or give one")
    return int(text)
