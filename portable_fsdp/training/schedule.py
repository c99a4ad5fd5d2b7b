"""Learning-rate schedule: linear warm-up, then cosine or linear decay to `min_lr_ratio * lr`, a constant rate, or
warmup-stable-decay (a pure function).

wsd follows torchtitan's warmup_stable_decay (torchtitan/components/lr_scheduler.py): the peak rate until the last
`round(decay_ratio * total_steps)` steps, which decay linearly to `min_lr_ratio * lr`, progress
(step + 1 - decay_start) / (decay_steps + 1); the warm-up is this module's own, shared by every shape."""
import math

SHAPES = ("cosine", "linear", "constant", "wsd")  # train.lr_schedule: the rate after the warm-up


def learning_rate(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float,
                  shape: str = "cosine", decay_ratio: float = 0.0) -> float:
    """The rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if shape == "wsd":
        return _warmup_stable_decay(step, lr, total_steps, min_lr_ratio, decay_ratio)
    if shape == "constant":
        return lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    remaining = 1.0 - progress if shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * remaining)


def _warmup_stable_decay(step: int, lr: float, total_steps: int, min_lr_ratio: float, decay_ratio: float) -> float:
    decay_steps = round(total_steps * decay_ratio)
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return lr
    progress = min(1.0, (step + 1 - decay_start) / (decay_steps + 1))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress))


def for_config(train_cfg):
    def schedule(step: int) -> float:
        return learning_rate(step, lr=train_cfg.lr, warmup_steps=train_cfg.warmup_steps,
                             total_steps=train_cfg.steps, min_lr_ratio=train_cfg.min_lr_ratio,
                             shape=train_cfg.lr_schedule, decay_ratio=train_cfg.decay_ratio)
    return schedule
