#!/usr/bin/env bash
# Install everything into .venv and run the default test suite (CPU only; gpu/tpu/slow/network markers excluded).
# Extra arguments go to pytest, e.g. `bash ci/test.sh tests/unit -x`. Two test files at a time (pytest-xdist, a file's
# tests and fixtures in one worker): most of a test's time is a process starting (imports, a launcher, a rendezvous)
# on one core, so two overlap on CI's two cores (21 min one at a time here, 13 two at a time).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv || exit 1
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]' || exit 1
.venv/bin/python -m pytest -m "not gpu and not tpu and not slow and not network" -n 2 --dist loadfile "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "error: pytest collected no tests; that is a failure, not a pass" >&2
    exit 1
fi
exit "$status"
