"""Running the xla test scripts: torch_xla fixes its device count and SPMD mode once per process, so every
xla run is a subprocess with its own environment."""
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
XLA_ENV = {"PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "2", "USE_TORCH_XLA": "0", "HF_HUB_OFFLINE": "1"}


def run_script(name: str, args: list, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(HERE / name), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **XLA_ENV})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def variants(tmp_dir: pathlib.Path, devices: int, steps: int, names: list) -> dict:
    out = tmp_dir / f"variants-{devices}.json"
    run_script("xla_variants.py", [out, devices, steps, *names], timeout=900)
    return json.loads(out.read_text())


def tiny_experts(hidden: int, intermediate: int, experts: int, top_k: int, seed: int = 0):
    """A seeded Mixtral experts module (transformers' fused experts) with weights of a trained model's scale."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(seed)
    config = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
                           num_experts_per_tok=top_k)
    config._experts_implementation = "eager"
    layer = MixtralExperts(config)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return layer
