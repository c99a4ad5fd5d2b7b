"""Run `portable_fsdp.run.main` in this process once per case and write what each printed and returned:

    python tests/xla/error_cases.py OUT.json CASES.json

CASES.json: a list of argument lists. One process for all (importing torch_xla costs seconds); every case is
refused at start-up, before torch_xla's runtime starts, so the cases cannot disturb one another.
"""
import contextlib
import io
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from portable_fsdp import run  # noqa: E402


def main(out: str, cases_file: str) -> None:
    results = []
    for args in json.loads(pathlib.Path(cases_file).read_text()):
        with tempfile.TemporaryDirectory() as workdir:
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr):
                code = run.main(["--backend", "xla", "--workdir", f"{workdir}/w", *args])
        results.append({"code": code, "stderr": stderr.getvalue().strip().splitlines()})
    pathlib.Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
