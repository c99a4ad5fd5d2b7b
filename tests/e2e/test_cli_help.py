"""`--help` lists every config field with its default and meaning; `--print_config` prints the config a run would
use (recipe, fsdp files and overrides applied) and exits 0 without starting anything."""
import json

from portable_fsdp import run
from portable_fsdp.config.schema import base_config, field_meanings, flat_fields
from tests.conftest import TEST_RECIPE


def test_every_field_has_a_meaning_beside_its_default():
    meanings = field_meanings()
    assert set(meanings) == set(flat_fields(base_config()))
    assert not [field for field, meaning in meanings.items() if not meaning]
    assert meanings["train.steps"] == "optimizer steps of the run; 0 = as many as train.epochs take"
    assert meanings["plan.fsdp_size"].startswith("ranks parameters are sharded over")  # plan.py's own docs


def test_help_lists_the_fields_with_defaults_and_meanings(capsys):
    assert run.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--print_config" in out
    lines = out.splitlines()
    at = lines.index("  train.steps = 300")
    assert lines[at + 1].strip() == "optimizer steps of the run; 0 = as many as train.epochs take"
    assert '  data.cache_dir = ""' in lines
    assert all(f"  {field} = " in out for field in flat_fields(base_config()))


def test_print_config_shows_recipe_file_and_overrides_then_exits(tmp_path, capsys):
    fsdp_config = tmp_path / "fsdp.json"
    fsdp_config.write_text(json.dumps({"reshard_after_forward": False}))
    workdir = tmp_path / "never"
    code = run.main(["--config", TEST_RECIPE, "--fsdp_config", str(fsdp_config), "--workdir", str(workdir),
                     "--print_config", "--config.train.steps=7"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert {"train.steps = 7", "model.hidden_size = 64", "plan.reshard_after_forward = false"} <= set(lines)
    assert len(lines) == len(flat_fields(base_config()))
    assert not workdir.exists()  # nothing started
