"""Whether every machine of a run sees the same workdir. On several machines the checkpoint is written in parts
(process 0 its manifest and `latest`, every process its own shard files) and resume reads them all back, so a
workdir on a disk of one machine leaves a checkpoint no machine can read whole. Imports no framework."""
from __future__ import annotations

import os
import pathlib
import re

from portable_fsdp.errors import notify

# Filesystems whose files every machine that mounts them sees (network, cluster and bucket filesystems).
SHARED_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                                "9p", "virtiofs", "fuse.gcsfuse", "fuse.s3fs", "fuse.goofys", "fuse.mountpoint-s3",
                                "fuse.juicefs", "fuse.sshfs", "fuse.rclone", "fuse.blobfuse2", "fuse.cephfs",
                                "fuse.glusterfs", "fuse.weka", "wekafs"})
URL = re.compile(r"^[a-z][a-z0-9+.-]*:/", re.IGNORECASE)  # gs://bucket/run, s3://bucket/run (gs:/ once a Path)


def filesystem_of(path: str, mounts: str) -> str:
    """The filesystem type of the mount holding `path` (absolute), from a /proc/mounts table: the longest mount
    point that is `path` or one of its parents. Mount points with spaces are written \\040 there."""
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def local_workdir_warning(workdir, mounts: str) -> str | None:
    """The one line for a run on several machines whose workdir is on a disk of this machine alone, else None."""
    text = str(workdir)
    if URL.match(text):
        return None
    kind = filesystem_of(os.path.realpath(text), mounts)
    if not kind or kind in SHARED_FILESYSTEMS:
        return None  # an unknown table says nothing either way
    return (f"--workdir {text} is on {kind}, a disk of this machine alone, and the run spans several machines: each "
            "keeps its own part of every checkpoint there, and resume needs them all in one place; use storage "
            "every machine sees (--workdir gs://bucket/run, or a shared mount such as NFS or gcsfuse)")


def warn_if_local(workdir, mounts_file: str = "/proc/mounts") -> None:
    """One `warning:` line at start-up when a run on several machines keeps its workdir on a local disk."""
    try:
        mounts = pathlib.Path(mounts_file).read_text()
    except OSError:  # not Linux: nothing to read the mounts from
        return
    message = local_workdir_warning(workdir, mounts)
    if message:
        notify(message)
