"""A bucket URL as a place to keep a workdir: the fsspec filesystem behind `s3://` (s3fs) or `gs://` (gcsfs), every
call retried with backoff on transient errors, and the errors a user can fix turned into one line.

A run with `--workdir s3://bucket/run` works in a local working copy (`local_workdir`; the rest of the code sees
only that directory) and names its bucket in the copy's `.remote` file (`working_copy`, `of`);
portable_fsdp.storage.sync moves checkpoints and records between the two. S3-compatible servers are reached
through the standard AWS_ENDPOINT_URL and credentials variables. Imports no framework.
"""
from __future__ import annotations

import asyncio
import functools
import os
import pathlib
import random
import sys
import time

from portable_fsdp.errors import UserError

# scheme -> (the fsspec package that serves it, how to give it credentials)
SCHEMES = {
    "s3": ("s3fs", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"),
    "gs": ("gcsfs", "set GOOGLE_APPLICATION_CREDENTIALS, or run `gcloud auth application-default login`"),
    "gcs": ("gcsfs", "set GOOGLE_APPLICATION_CREDENTIALS, or run `gcloud auth application-default login`"),
}
MARKER = ".remote"  # in a local working copy: the URL of the bucket prefix it mirrors
RETRY_TOTAL_S = 120.0  # a transient error lasting longer than this is a failure
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 15.0


def is_url(workdir) -> bool:
    return "://" in str(workdir)


def transient(err: BaseException) -> bool:
    """Whether a failed call may succeed if tried again: a dropped connection, a timeout, a 429 or a 5xx."""
    if isinstance(err, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    status = getattr(err, "code", None)  # gcsfs's HttpError
    if isinstance(status, int):
        return status == 429 or status >= 500
    try:
        from s3fs.core import S3_RETRYABLE_ERRORS

        if isinstance(err, S3_RETRYABLE_ERRORS):
            return True
    except ImportError:
        pass
    # s3fs turns a throttled or failed request into a plain OSError carrying the server's words
    return any(word in str(err) for word in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                                             "Throttl", "TooManyRequests"))


def retrying(call, *args, total_s: float | None = None, **kwargs):
    """`call(*args, **kwargs)`, tried again after an exponential backoff with full jitter while its errors are
    transient and `total_s` (RETRY_TOTAL_S) has not passed."""
    deadline, attempt = time.monotonic() + (RETRY_TOTAL_S if total_s is None else total_s), 0
    while True:
        try:
            return call(*args, **kwargs)
        except Exception as err:
            pause = random.uniform(0, min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** attempt))
            if not transient(err) or time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            attempt += 1


class Remote:
    """A prefix `url` of a bucket; paths are relative to it ("checkpoints/latest")."""

    def __init__(self, url: str, fs):
        self.url, self.fs = url.rstrip("/"), fs
        self.root = self.url.split("://", 1)[1]

    def path(self, relative: str = "") -> str:
        return f"{self.root}/{relative}".rstrip("/")

    def read_text(self, relative: str) -> str | None:
        """The object's text; None when there is none."""
        try:
            return retrying(self.fs.cat_file, self.path(relative)).decode()
        except FileNotFoundError:
            return None

    def write_text(self, relative: str, text: str, exclusive: bool = False) -> None:
        """`exclusive`: FileExistsError when the object exists (a conditional create on the server)."""
        retrying(self.fs.pipe_file, self.path(relative), text.encode(), mode="create" if exclusive else "overwrite")

    def put(self, local: pathlib.Path, relative: str) -> None:
        retrying(self.fs.put_file, str(local), self.path(relative))

    def get(self, relative: str, local: pathlib.Path) -> None:
        pathlib.Path(local).parent.mkdir(parents=True, exist_ok=True)
        retrying(self.fs.get_file, self.path(relative), str(local))

    def sizes(self, relative: str) -> dict:
        """{name relative to `relative`: bytes} of every object under it (fresh, not from a cache)."""
        self.fs.invalidate_cache()
        prefix = self.path(relative)
        try:
            found = retrying(self.fs.find, prefix, detail=True)
        except FileNotFoundError:
            return {}
        return {name[len(prefix) + 1:]: info["size"] for name, info in found.items() if name.startswith(prefix + "/")}

    def children(self, relative: str) -> list:
        """The names directly under `relative`."""
        self.fs.invalidate_cache()
        try:
            return sorted(p.rsplit("/", 1)[-1] for p in retrying(self.fs.ls, self.path(relative), detail=False))
        except FileNotFoundError:
            return []

    def remove(self, relative: str) -> None:
        """The object, or every object under the prefix; nothing when there is none."""
        try:
            retrying(self.fs.rm, self.path(relative), recursive=True)
        except FileNotFoundError:
            pass


def open_remote(url: str) -> Remote:
    """The bucket prefix `url`, its filesystem made (nothing is read yet: `check_access`)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise UserError("--workdir", f"{url}: {scheme}:// is not a supported storage; use a local directory, "
                        "s3://bucket/path or gs://bucket/path")
    package = SCHEMES[scheme][0]
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    if not bucket:
        raise UserError("--workdir", f"{url} names no bucket; use {scheme}://bucket/path")
    try:
        import fsspec

        fs = fsspec.filesystem(scheme, skip_instance_cache=True)
    except ImportError:
        raise UserError("--workdir", f"{scheme}:// needs the {package} package; pip install "
                        "'portable_fsdp[cloud]'") from None
    return Remote(url, fs)


def check_access(remote: Remote) -> None:
    """Before any worker starts: UserError in one line for missing credentials, a missing bucket or a refusal."""
    scheme = remote.url.split("://", 1)[0].lower()
    bucket = remote.root.split("/", 1)[0]
    try:
        retrying(remote.fs.ls, bucket, detail=False, total_s=RETRY_FIRST_S * 8)
    except FileNotFoundError:
        raise UserError("--workdir", f"{remote.url}: the bucket {bucket} does not exist; create it or choose "
                        "another --workdir") from None
    except PermissionError:
        raise UserError("--workdir", f"{remote.url}: access to the bucket {bucket} is denied to these credentials; "
                        "grant them read and write access or choose another --workdir") from None
    except Exception as err:
        if "credentials" in f"{type(err).__name__} {err}".lower():  # botocore's NoCredentialsError, google.auth's
            raise UserError("--workdir", f"{remote.url}: no credentials found; {SCHEMES[scheme][1]}") from None
        if transient(err):
            raise UserError("--workdir", f"{remote.url}: the storage service cannot be reached ({err}); check the "
                            "network or AWS_ENDPOINT_URL") from None
        raise


def local_workdir(url: str) -> pathlib.Path:
    """Where a run works on `url`: $PORTABLE_FSDP_LOCAL_WORKDIRS/<scheme>/<bucket>/<path>, by default under
    $XDG_CACHE_HOME/portable_fsdp/workdirs (~/.cache/...)."""
    scheme, rest = url.rstrip("/").split("://", 1)
    base = os.environ.get("PORTABLE_FSDP_LOCAL_WORKDIRS") or pathlib.Path(
        os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "portable_fsdp" / "workdirs"
    return pathlib.Path(base) / scheme / rest


def working_copy(url: str) -> pathlib.Path:
    """Before any worker starts: check that `url` can be used (one line if not), and return the local directory
    the run works in, marked as `url`'s copy (every process of the run finds its bucket there: `of`)."""
    check_access(open_remote(url))
    local = local_workdir(url)
    local.mkdir(parents=True, exist_ok=True)
    (local / MARKER).write_text(url.rstrip("/") + "\n")
    print(f"--workdir {url}: working in {local}, synchronised with the bucket (PORTABLE_FSDP_LOCAL_WORKDIRS moves "
          "it)", file=sys.stderr, flush=True)
    return local


@functools.lru_cache(maxsize=None)
def _opened(url: str) -> Remote:
    return open_remote(url)


def of(workdir: pathlib.Path) -> Remote | None:
    """The bucket prefix a local working copy mirrors; None for a workdir that is only local."""
    marker = pathlib.Path(workdir) / MARKER
    return _opened(marker.read_text().strip()) if marker.is_file() else None
