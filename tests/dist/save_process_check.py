"""Run by test_save_process.py under torchrun (2 ranks, gloo): each rank's background checkpoint writer process
(portable_fsdp/backends/torch/save_process.py) writes and checksums the staged shards, keeps running through Ctrl-C, reports a failed write
and a death as errors naming the rank, and is gone after close."""
import concurrent.futures
import os
import pathlib
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from portable_fsdp.checkpoint import layout as checkpointing
from portable_fsdp.backends.torch import save_process, sharded_writer
from portable_fsdp.backends.torch.checkpoint import _stager


def state(scale: float) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6) * scale
    return {"weight": distribute_tensor(full, mesh, [Shard(0)]), "step": torch.tensor([scale])}


def write(bundle: dict, where: str):
    staging = concurrent.futures.Future()
    staging.set_result(_stager("cpu").stage(bundle))
    return save_process.submit(staging, where, timeout_s=120)


def read(where: str, scale: float) -> None:
    fresh = state(0.0)
    dcp.load(fresh, checkpoint_id=where)
    assert torch.equal(fresh["weight"].full_tensor(), state(scale)["weight"].full_tensor()), where
    assert fresh["step"].item() == scale


def expect_failure(future, words: str) -> None:
    try:
        future.result()
    except save_process.WriterFailed as err:
        assert f"rank {dist.get_rank()}'s checkpoint writer" in str(err) and words in str(err), str(err)
    else:
        raise AssertionError(f"no error ({words})")


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = pathlib.Path(sys.argv[1])
    staged = _stager("cpu").stage(state(1.0))
    assert staged["weight"].to_local().is_shared()  # handed to the writer as file descriptors, not bytes
    files = write(state(1.0), str(root / "one")).result()
    assert set(files) == set(sharded_writer.written_files(root / "one", rank)) and files  # shards (rank 0: metadata)
    assert all(entry == checkpointing.digest(path) for path, entry in files.items())  # fsynced and checksummed there
    writer = save_process._writer.process
    assert writer.pid != os.getpid() and writer.is_alive()
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, writer.pid) == min(niceness + 10, 19)  # yields to training (19: the least)
    dist.barrier()
    read(str(root / "one"), 1.0)

    os.kill(writer.pid, signal.SIGINT)  # Ctrl-C reaches every process of the terminal's group
    write(state(2.0), str(root / "two")).result()  # the same staging buffers, refilled
    assert writer.is_alive()
    dist.barrier()
    read(str(root / "two"), 2.0)

    (root / f"file_{rank}").write_text("not a directory")
    expect_failure(write(state(3.0), str(root / f"file_{rank}" / "three")), "failed:")
    write(state(4.0), str(root / "four")).result()  # the writer serves on after a failed save
    dist.barrier()
    read(str(root / "four"), 4.0)

    dist.barrier()
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    expect_failure(write(state(5.0), str(root / "five")), "died")
    save_process.close()
    assert save_process._writer is None and not writer.is_alive()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)


def hold() -> None:
    """Two ranks started by hand; only rank 0 saves, so its writer waits in its group's rendezvous for rank 1's
    (busy, not reading requests). Rank 0 says its writer's pid and both wait to be killed."""
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        staging = concurrent.futures.Future()
        staging.set_result({"step": torch.tensor([1.0])})
        save_process.submit(staging, sys.argv[1], timeout_s=300)
        print(save_process._writer.process.pid, flush=True)
    else:
        dist.broadcast_object_list([None], src=0)  # the writers' address, as rank 1's own first save would take it
    time.sleep(600)


if __name__ == "__main__":
    hold() if sys.argv[2:] == ["hold"] else main()
