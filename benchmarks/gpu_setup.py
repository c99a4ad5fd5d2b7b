"""The GPU machine's set-up in one command, with no network there: every package that `python -m benchmarks.gpu`,
`python -m portable_fsdp.selftest` and the GPU tests need beside the torch the machine already has, as wheels in
one folder prepared where there is a network. Standard library only: it runs before anything is installed.

Here (with a network), for the GPU machine's Python and torch (`python3 -c "import torch; print(torch.__version__)"`
there):

    python -m benchmarks.gpu_setup download --python 3.12 --torch 2.11.0 [--dest gpu_wheels] [--present FREEZE]

resolves the closure of the project's requirements (pyproject.toml's, torch left out: a stand-in torch of the given
version answers for it), the torchao release built for that torch, and pytest, for that Python on x86-64 Linux,
and downloads their wheels; `--present` (the GPU machine's `pip list --format=freeze`) leaves out what it has.
There (no network), from the repository's root:

    python -m benchmarks.gpu_setup install [--wheels gpu_wheels]

installs them with `pip install --no-index` and imports every module the runs need; exit 1 naming what is missing.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile

from portable_fsdp.machine import gpu_packages  # (the package's __init__ imports nothing installed)

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHEELS = ROOT / "gpu_wheels"
REQUIREMENTS = "requirements.txt"
# What the runs import, beside torch: the product, its float8 path, the benchmark, the GPU tests.
MODULES = ("transformers", "accelerate", "datasets", "ml_collections", "safetensors", "yaml", "tqdm", "psutil",
           "xxhash", "numpy", "torchao.float8", "pytest", "portable_fsdp.backends.torch", "portable_fsdp.selftest",
           "benchmarks.gpu")
PLATFORMS = ["manylinux2014_x86_64", "manylinux1_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(5, 40))]
STAND_IN = "gpubox"  # the local version label of the stand-in torch


def torchao_for(torch_version: str) -> str:
    try:
        return gpu_packages.torchao_for(torch_version)
    except (ValueError, AttributeError):
        raise SystemExit(f"error: --torch {torch_version}: give the GPU machine's torch, 2.9 or newer") from None


def requirements(torch_version: str) -> list:
    """pyproject.toml's requirements but torch's, torchao for `torch_version`, and the GPU tests' pytest."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip carries the same parser
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    kept = [r for r in project["dependencies"] if re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() != "torch"]
    return [*kept, f"torchao=={torchao_for(torch_version)}", "pytest>=8", "pytest-timeout"]


def stand_in_torch(directory: pathlib.Path, version: str) -> pathlib.Path:
    """A wheel named torch, of `version` with a local label, holding nothing: the resolver counts torch as the
    GPU machine's own and downloads none of its gigabytes."""
    name = f"torch-{version}+{STAND_IN}-py3-none-any.whl"
    info = f"torch-{version}+{STAND_IN}.dist-info"
    with zipfile.ZipFile(directory / name, "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}+{STAND_IN}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return directory / name


def project_name(wheel: pathlib.Path) -> str:
    return _normal(wheel.name.split("-")[0])


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(present: pathlib.Path, python: str, wanted: list, wheels: pathlib.Path) -> set:
    """The projects of `present` (name==version lines) whose version meets every requirement on them in the
    closure (`wanted` and the downloaded wheels' own, for the GPU machine's Python on Linux): pip there keeps
    those, so their wheels need not travel."""
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

    versions = {_normal(n): v for n, _, v in (line.strip().partition("==") for line in present.read_text().splitlines())
                if v}
    environment = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
    needs = [Requirement(r) for r in wanted]
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            lines = archive.read(metadata).decode().splitlines()
        needs += [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    met = {name for name, version in versions.items() if _is_version(version, Version)}
    for need in needs:
        name = _normal(need.name)
        if name in met and (need.marker is None or need.marker.evaluate(environment)):
            if not need.specifier.contains(Version(versions[name]), prereleases=True):
                met.discard(name)
    return met


def _is_version(text: str, version) -> bool:
    try:
        version(text)
        return True
    except ValueError:
        return False


def download(python: str, torch_version: str, dest: pathlib.Path, present: pathlib.Path | None) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    wanted = requirements(torch_version)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        stand_in_torch(scratch, torch_version)
        (scratch / "constraints.txt").write_text(f"torch=={torch_version}+{STAND_IN}\n")
        command = [sys.executable, "-m", "pip", "download", "--dest", str(dest), "--only-binary=:all:",
                   "--python-version", python, "--implementation", "cp", "--find-links", str(scratch),
                   "--constraint", str(scratch / "constraints.txt"), *(f"--platform={p}" for p in PLATFORMS), *wanted]
        proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"error: pip download failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return 1
    have = _installed(present, python, wanted, dest) if present else set()
    for wheel in dest.glob("*.whl"):
        if project_name(wheel) == "torch" or project_name(wheel) in have:
            wheel.unlink()
    (dest / REQUIREMENTS).write_text("\n".join(wanted) + "\n")
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB, in {dest} (Python {python}, torch {torch_version}); on the GPU "
          f"machine: python -m benchmarks.gpu_setup install --wheels {dest.name}")
    return 0


def install(wheels: pathlib.Path) -> int:
    listed = wheels / REQUIREMENTS
    if not listed.is_file():
        print(f"error: {listed} is missing; prepare the folder with python -m benchmarks.gpu_setup download",
              file=sys.stderr)
        return 1
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                           "-r", str(listed)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"error: pip install failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return 1
    return check()


def check() -> int:
    """Import every module the runs need (from the repository's root): all at once, then — when that fails —
    each in a process of its own, to name every one that does not import."""
    def imports(modules) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in modules)], cwd=ROOT,
                              capture_output=True, text=True)

    missing = []
    if imports(MODULES).returncode != 0:
        for module in MODULES:
            proc = imports([module])
            if proc.returncode != 0:
                missing.append(f"{module} ({(proc.stderr.strip().splitlines() or ['?'])[-1]})")
    if missing:
        print(f"error: cannot import {'; '.join(missing)}", file=sys.stderr)
        return 1
    print(f"ready: {len(MODULES)} modules import (python -m portable_fsdp.selftest, python -m benchmarks.gpu)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_setup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    get = verbs.add_parser("download", help="(with a network) the wheels for the GPU machine")
    get.add_argument("--python", required=True, help="the GPU machine's Python, e.g. 3.12")
    get.add_argument("--torch", required=True, help="the GPU machine's torch, e.g. 2.11.0")
    get.add_argument("--dest", type=pathlib.Path, default=WHEELS)
    get.add_argument("--present", type=pathlib.Path, default=None,
                     help="the GPU machine's `pip list --format=freeze`: what it has is left out")
    put = verbs.add_parser("install", help="(on the GPU machine, no network) install the wheels and check imports")
    put.add_argument("--wheels", type=pathlib.Path, default=WHEELS)
    args = parser.parse_args(argv)
    if args.verb == "download":
        return download(args.python, args.torch, args.dest, args.present)
    return install(args.wheels)


if __name__ == "__main__":
    sys.exit(main())
