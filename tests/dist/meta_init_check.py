"""Run under torchrun (gloo): start the torch lowering on each named case and write to JSON what rank 0 sees of
the initial weights — whether any rank built the whole model, whether the gathered FULL state dict and the
buffers equal the single-process init bit for bit, whether tied embeddings are one parameter — or, in `memory`
mode, every rank's resident memory right after start-up (and before the model existed).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/meta_init_check.py OUT.json CASE...
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from portable_fsdp.machine import host_memory
from portable_fsdp.backends.hf_torch import model as model_lib
from portable_fsdp.backends.torch import step as torch_step
from portable_fsdp.config.validate import resolve_plan
from tests.parity.matrix import make_config
from tests.dist.launch import write_results

TIED = {"model.tie_word_embeddings": "true"}
# ~110M parameters: 32000 x 768 tied embeddings, 12 layers of 768 / 2048
LLAMA_100M = {"model.vocab_size": "32000", "model.hidden_size": "768", "model.intermediate_size": "2048",
              "model.num_hidden_layers": "12", "model.num_attention_heads": "12", "model.num_key_value_heads": "12",
              **TIED}
CASES = {
    "fsdp": {},
    "tied": TIED,
    "tied_checkpointed": {**TIED, "plan.activation_checkpointing": "true"},
    "tp2": {"plan.tp_size": "2"},
    "tied_tp2": {**TIED, "plan.tp_size": "2"},
    "cpu_offload": {"plan.cpu_offload": "true"},
    "llama_100m": LLAMA_100M,
}
MOE_CONFIG = "moe_config"  # a case whose name starts so reads model.config_from from the environment
# (as "pretrained" cases read model.init_from)

whole_builds = []
_create_model = model_lib.create_model


def counting_create_model(*args, **kwargs):
    whole_builds.append(1)
    return _create_model(*args, **kwargs)


model_lib.create_model = counting_create_model


def overrides_for(name: str) -> dict:
    if name.startswith("pretrained"):  # pretrained / pretrained_tp2: a tied model saved in PRETRAINED
        return {"model.init_from": os.environ["PRETRAINED"], **({"plan.tp_size": "2"} if name.endswith("tp2") else {})}
    if name.startswith(MOE_CONFIG):  # moe_config / moe_config_ep2
        ep = {"plan.ep_size": "2"} if name.endswith("ep2") else {}
        return {"model.config_from": os.environ["MOE_CONFIG"], **ep}
    return CASES[name]


def bits(name: str) -> dict:
    config = make_config(overrides_for(name))
    plan = resolve_plan(config, int(os.environ["WORLD_SIZE"]))
    whole_builds.clear()
    state = torch_step.init(config, plan, "cpu")
    built_whole = bool(whole_builds)
    model = state.model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    buffers = {n.replace("_checkpoint_wrapped_module.", ""): b for n, b in model.named_buffers()}
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    if dist.get_rank() != 0:
        return {}
    reference = _create_model(config, rank=0, rank0_only=False)
    expected = reference.state_dict()
    differing = sorted(n for n in expected if n in full and not torch.equal(full[n].cpu(), expected[n]))
    differing += sorted(n for n, b in reference.named_buffers() if not torch.equal(buffers[n].cpu(), b))
    reference_tied = reference.get_input_embeddings().weight is reference.get_output_embeddings().weight
    return {"built_whole": built_whole, "missing": sorted(set(expected) - set(full)), "differing": differing,
            "compared": len(expected), "tied": tied, "reference_tied": reference_tied}


def memory(name: str) -> dict:
    config = make_config(CASES[name])
    plan = resolve_plan(config, int(os.environ["WORLD_SIZE"]))
    state = torch_step.init(config, plan, "cpu")
    mine = torch.tensor([host_memory.resident_mb(), state.ctx.baseline_mb], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    params = sum(p.numel() for p in state.model.parameters())
    return {"resident_mb": [g[0].item() for g in gathered], "baseline_mb": [g[1].item() for g in gathered],
            "params": params}


def main() -> None:
    out, mode, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    results = {name: (memory if mode == "memory" else bits)(name) for name in names}
    write_results(out, results)
    torch_step.finalize()


if __name__ == "__main__":
    main()
