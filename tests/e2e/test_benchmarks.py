"""The benchmark scripts still run (slow: they start several multi-process runs). They measure nothing
here: tiny models, a few steps."""
import json
import pathlib
import subprocess
import sys
import tempfile

import pytest

from benchmarks.hf_trainer import run_hf_trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--config.model.hidden_size=64", "--config.model.intermediate_size=160", "--config.model.num_hidden_layers=2",
        "--config.model.num_attention_heads=4", "--config.model.num_key_value_heads=2"]


@pytest.mark.slow
def test_hf_trainer_really_trains_with_fsdp2_on_cpu():
    result = run_hf_trainer(TINY, seq_len=64, global_batch=4, steps=3)
    assert result["fsdp2"] is True and len(result["step_seconds"]) == 3 and result["tokens_per_sec"] > 0


@pytest.mark.slow
def test_quick_suite_writes_every_section():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((pathlib.Path(tempfile.gettempdir()) / "portable_fsdp_suite_quick.json").read_text())
    assert {"throughput", "memory", "scaling", "communication", "overhead", "machine"} <= set(results)
    for row in results["communication"]["rows"]:
        sent = row["sent_per_step"]
        assert sent["all_gather"] + sent["reduce_scatter"] == pytest.approx(row["expected_bytes"], rel=1e-3)


def test_an_unknown_section_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--only", "speed"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown section(s) ['speed']" in proc.stderr.strip().splitlines()[-1]
