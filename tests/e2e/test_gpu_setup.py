"""The GPU machine's set-up (benchmarks/gpu_setup.py) as that machine meets it: a fresh virtual environment that
has torch and nothing else installs the prepared folder with `pip install --no-index` and imports every module the
runs need.

The folder a GPU machine gets is downloaded for its Python (`gpu_setup download`, which needs a network: the
`network` test below). The default test, which must not download, makes the same folder for this machine's Python
from the distributions installed here: each one of the closure of the set-up's requirements (torch's own left out,
as the GPU machine has them) packed back into a wheel. What it proves is the rest: the requirement list, the
offline install and the import check."""
import base64
import hashlib
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest
import torch
from pip._vendor.packaging.requirements import Requirement

from benchmarks import gpu_setup
from tests.conftest import ROOT


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list) -> set:
    """The installed distributions `requirements` need, recursively (markers for this interpreter, extras
    followed)."""
    found, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        need = todo.pop()
        name = normal(need.name)
        if name in found:
            continue
        found.add(name)
        for text in importlib.metadata.requires(need.name) or []:
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in ("", *need.extras)):
                todo.append(child)
    return found


def repack(name: str, folder: pathlib.Path) -> None:
    """The installed distribution `name` as a wheel again: its files under site-packages and its metadata."""
    dist = importlib.metadata.distribution(name)
    site = pathlib.Path(dist.locate_file("")).resolve()
    info = next(str(f).split("/")[0] for f in dist.files if str(f).endswith(".dist-info/METADATA"))
    tags = [line.split(":", 1)[1].strip().split("-") for line in dist.read_text("WHEEL").splitlines()
            if line.startswith("Tag:")]
    tag = "-".join(".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3))  # py2.py3-none-any
    wheel = folder / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w") as archive:  # stored: the test's time goes to the install, not to deflate
        for file in dist.files:
            path = pathlib.Path(dist.locate_file(file)).resolve()
            inside = str(path).startswith(str(site) + os.sep)
            if not inside or not path.is_file() or file.name in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
                continue
            data = path.read_bytes()
            archive.writestr(str(file), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{file},sha256={digest},{len(data)}")
        archive.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")


def expose(names: set, directory: pathlib.Path, venv: pathlib.Path) -> None:
    """`names` (torch and what it needs) visible to `venv`'s Python, as on a GPU machine that has them: their
    top-level files linked into `directory`, named by a .pth file."""
    directory.mkdir()
    for name in names:
        dist = importlib.metadata.distribution(name)
        for top in {pathlib.PurePath(f).parts[0] for f in dist.files}:
            source = pathlib.Path(dist.locate_file(top))
            target = directory / top
            if source.exists() and not target.exists() and not top.startswith(".."):
                target.symlink_to(source)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "gpu_machine_torch.pth").write_text(str(directory) + "\n")


@pytest.mark.slow  # a fresh venv installed from a wheel folder (2-4 min on 2 cores); the folder's contents are checked by default
def test_a_fresh_environment_with_torch_installs_the_folder_offline_and_imports_what_the_runs_need(tmp_path):
    wanted = gpu_setup.requirements(torch.__version__)
    torch_has = closure(["torch"])
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in sorted(closure(wanted) - torch_has):
        repack(name, folder)
    (folder / gpu_setup.REQUIREMENTS).write_text("\n".join(wanted) + "\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    expose(torch_has, tmp_path / "torch_site", venv)
    python = venv / "bin" / "python"
    before = subprocess.run([str(python), "-c", "import transformers"], capture_output=True, text=True)
    assert before.returncode != 0  # fresh: nothing but torch
    proc = subprocess.run([str(python), "-m", "benchmarks.gpu_setup", "install", "--wheels", str(folder)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PIP_")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(f"ready: {len(gpu_setup.MODULES)} modules import")


def test_the_requirements_are_the_projects_but_torch_with_the_torchao_for_that_torch():
    wanted = gpu_setup.requirements("2.11.0+cu130")
    assert "torchao==0.17.0" in wanted and "datasets" in wanted and "xxhash" in wanted
    assert not any(r.startswith("torch") and not r.startswith("torchao") for r in wanted)
    with pytest.raises(SystemExit, match="give the GPU machine's torch, 2.9 or newer"):
        gpu_setup.requirements("2.8.0")


@pytest.mark.network
def test_the_download_for_the_gpu_machine_holds_the_closure_but_torch(tmp_path):
    """Downloads (about 110 MiB): run where there is a network, `python -m pytest -m network`."""
    present = tmp_path / "present.txt"
    present.write_text("numpy==99.0.0\nml-collections==0.0.1\n")  # numpy kept there; an ml_collections too old
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_setup", "download", "--python", "3.12", "--torch",
                           "2.11.0", "--dest", str(tmp_path / "w"), "--present", str(present)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {normal(w.name.split("-")[0]) for w in (tmp_path / "w").glob("*.whl")}
    assert {"transformers", "accelerate", "datasets", "ml-collections", "xxhash", "torchao", "pytest"} <= names
    assert not names & {"torch", "numpy", "triton"} and not any(n.startswith("nvidia") for n in names)
    assert any(w.name.startswith("torchao-0.17.0") for w in (tmp_path / "w").glob("*.whl"))
    assert all("cp312" in w.name or "abi3" in w.name or "none" in w.name for w in (tmp_path / "w").glob("*.whl"))
