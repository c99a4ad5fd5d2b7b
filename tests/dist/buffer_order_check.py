"""One rank of two (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment; each started with its own
PYTHONHASHSEED): rank 0 computes two non-persistent buffers of one shape, as Gemma 3's two rotary tables, rank 1
receives them through model.broadcast_computed_buffers. Rank 1 prints whether each arrived under its own name.

    RANK=r WORLD_SIZE=2 ... python tests/dist/buffer_order_check.py
"""
import torch
import torch.distributed as dist

from portable_fsdp.backends.torch.model import broadcast_computed_buffers

NAMES = ("sliding_attention_inv_freq", "full_attention_inv_freq")


class Rotary(torch.nn.Module):
    def __init__(self, computed: bool):
        super().__init__()
        for index, name in enumerate(NAMES):
            value = torch.full((4,), float(index + 1)) if computed else torch.zeros(4)
            self.register_buffer(name, value, persistent=False)


def main() -> None:
    dist.init_process_group("gloo")
    model = Rotary(computed=dist.get_rank() == 0)
    broadcast_computed_buffers(model)
    if dist.get_rank() == 1:
        print(" ".join(f"{name}={getattr(model, name)[0].item():g}" for name in NAMES), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
