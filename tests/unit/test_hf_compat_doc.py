"""docs/hf_compat.md names every Hugging Face / Accelerate key, word and flag the importers read, so the page a
user checks cannot fall behind the code."""
import pathlib

import pytest

from portable_fsdp import run
from portable_fsdp.config import accelerate
from portable_fsdp.config.hf_import import (FSDP_OPTION_WORDS, NO_OP_KEYS, PARALLELISM_IGNORED, PARALLELISM_KEYS,
                                            PLAN_KEYS, STRATEGY_NUMBERS, STRATEGY_WORDS)

DOC = (pathlib.Path(__file__).parents[2] / "docs" / "hf_compat.md").read_text()
NAMES = sorted({*PLAN_KEYS, *NO_OP_KEYS, "version", "sharding_strategy", *STRATEGY_NUMBERS.values(), *STRATEGY_WORDS,
                *FSDP_OPTION_WORDS, *accelerate.PLAN_KEYS, *accelerate.PROCESS_KEYS, *accelerate.IGNORED_KEYS,
                "compute_environment", "distributed_type", "use_cpu", *PARALLELISM_KEYS, *PARALLELISM_IGNORED,
                *run.PARALLELISM_FLAGS, "use_parallelism_config"})


@pytest.mark.parametrize("name", NAMES)
def test_the_page_names_it(name):
    assert f"`{name}`" in DOC or f"`{name} " in DOC or f"{name}`" in DOC, name
