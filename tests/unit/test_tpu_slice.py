"""Runs over several hosts decided without a framework: which rows of the global batch a host feeds
(placement.host_data_slice), which host of a TPU slice this is (tpu_vm.slice_workers, environment and metadata
injected) and the one line about a workdir that not every machine sees (launch/shared_workdir.py, mounts injected)."""
import pathlib

import pytest

from portable_fsdp import placement
from portable_fsdp.errors import Notice
from portable_fsdp.launch import shared_workdir
from portable_fsdp.machine import tpu_vm
from tests.unit._helpers import user_error


def host_positions(host: int, per_host: int) -> list:
    """The mesh positions of a host's devices when each host drives a contiguous run of them (TPU slices)."""
    return list(range(host * per_host, (host + 1) * per_host))


# (hosts, devices per host, data rows of the mesh): the hosts' (dp_rank, dp_size) in host order
SLICES = [
    (2, 4, 8, [(0, 2), (1, 2)]),  # v5p-16: 2 hosts x 4 chips, every device a row (fsdp 8)
    (4, 4, 16, [(0, 4), (1, 4), (2, 4), (3, 4)]),  # v5p-32
    (2, 4, 4, [(0, 2), (1, 2)]),  # v5p-16 with tp 2: two rows of two chips on each host
    (2, 4, 2, [(0, 2), (1, 2)]),  # tp 4: one row per host
    (1, 8, 8, [(0, 1)]),  # one host drives everything
    (8, 4, 32, [(h, 8) for h in range(8)]),  # v5p-64
]


@pytest.mark.parametrize("hosts, per_host, data_rows, expected", SLICES)
def test_each_host_feeds_its_own_block_of_rows(hosts, per_host, data_rows, expected):
    got = [placement.host_data_slice(host_positions(h, per_host), hosts * per_host, data_rows, "plan.tp_size")
           for h in range(hosts)]
    assert got == expected


def test_the_hosts_rows_cover_the_global_batch_once():
    """v5p-16, global batch 16: host 0 rows 0-7, host 1 rows 8-15, as the loader cuts dp_rank of dp_size."""
    rows = []
    for host in range(2):
        dp_rank, dp_size = placement.host_data_slice(host_positions(host, 4), 8, 8, "plan.fsdp_size")
        per_host = 16 // dp_size
        rows.append(list(range(dp_rank * per_host, (dp_rank + 1) * per_host)))
    assert rows == [list(range(8)), list(range(8, 16))]


def test_a_row_split_over_hosts_is_one_line():
    """tp 8 on two hosts of 4: a row's devices span both hosts, and neither can feed it alone."""
    with user_error("plan.tp_size", "make cp_size x sp_size x tp_size a divisor of this host's device count (4)"):
        placement.host_data_slice(host_positions(0, 4), 8, 1, "plan.tp_size")


@pytest.mark.parametrize("positions, device_count, data_rows", [
    ([0, 1, 4, 5], 8, 8),  # not one block
    ([2, 3, 4], 8, 8),  # a block of 3 rows does not divide 8 (uneven hosts)
    ([1, 2], 8, 8),  # a block not aligned to its size
    ([0, 1, 2], 8, 4),  # half a row of two devices
])
def test_uneven_or_scattered_hosts_are_refused(positions, device_count, data_rows):
    with user_error("plan.fsdp_size", "span hosts"):
        placement.host_data_slice(positions, device_count, data_rows, "plan.fsdp_size")


def metadata_of(attributes: dict):
    return lambda key: attributes.get(key, "")


@pytest.mark.parametrize("environ, attributes, visible, expected", [
    ({}, {}, False, (0, 1)),  # no TPU
    ({"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1"}, {}, False, (1, 2)),  # GKE, xpk
    ({"TPU_WORKER_HOSTNAMES": "only-host"}, {}, False, (0, 1)),
    ({}, {"agent-worker-number": "3", "worker-network-endpoints": "a:u:10.0.0.1,b:u:10.0.0.2,c:u:10.0.0.3,"
                                                                  "d:u:10.0.0.4"}, True, (3, 4)),  # a TPU VM
    ({}, {"agent-worker-number": "0", "worker-network-endpoints": "10.0.0.1"}, True, (0, 1)),  # v5p-8: one host
    ({}, {}, True, (0, 1)),  # TPU chips but no metadata server
])
def test_slice_workers(environ, attributes, visible, expected):
    assert tpu_vm.slice_workers(environ, metadata_of(attributes), lambda: visible) == expected


def test_the_environment_wins_over_the_metadata():
    attributes = {"agent-worker-number": "0", "worker-network-endpoints": "a,b"}
    assert tpu_vm.slice_workers({"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "a,b"}, metadata_of(attributes),
                                lambda: True) == (1, 2)


MOUNTS = """\
overlay / overlay rw,relatime 0 0
/dev/sda1 /home ext4 rw,relatime 0 0
10.0.0.2:/export /home/team/shared nfs4 rw,relatime 0 0
my-bucket /mnt/bucket fuse.gcsfuse rw,nosuid 0 0
tmpfs /dev/shm tmpfs rw 0 0
/dev/sdb /mnt/my\\040disk xfs rw 0 0
"""


@pytest.mark.parametrize("workdir, kind", [
    ("/home/me/run", "ext4"), ("/home/team/shared/run", "nfs4"), ("/home/team/sharedrun", "ext4"),
    ("/mnt/bucket/run", "fuse.gcsfuse"), ("/tmp/run", "overlay"), ("/mnt/my disk/run", "xfs"), ("/home", "ext4"),
])
def test_the_longest_mount_point_decides(workdir, kind):
    assert shared_workdir.filesystem_of(workdir, MOUNTS) == kind


@pytest.mark.parametrize("workdir", ["gs://bucket/run", "s3://bucket/run", pathlib.Path("gs://bucket/run"),
                                     "/home/team/shared/run", "/mnt/bucket/r"])
def test_storage_every_machine_sees_says_nothing(workdir):
    assert shared_workdir.local_workdir_warning(workdir, MOUNTS) is None


def test_a_local_disk_is_one_line_naming_the_fix():
    assert shared_workdir.local_workdir_warning("/home/me/run", MOUNTS) == (
        "--workdir /home/me/run is on ext4, a disk of this machine alone, and the run spans several machines: each "
        "keeps its own part of every checkpoint there, and resume needs them all in one place; use storage every "
        "machine sees (--workdir gs://bucket/run, or a shared mount such as NFS or gcsfuse)")


def test_the_warning_is_a_notice(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n")
    with pytest.warns(Notice, match="is on ext4"):
        shared_workdir.warn_if_local(tmp_path / "run", str(mounts))
    shared_workdir.warn_if_local(tmp_path / "run", str(tmp_path / "absent"))  # no table: no line
