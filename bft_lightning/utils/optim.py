"""AdamW with parameter groups and a warm-up + cosine schedule, shared by the tasks.

Three groups: weights with decay; norms and biases without; the precision
parameters (layer-0 ``tau`` tables or MLPs under a ``prior`` module, and every
layer's ``rho``) without decay and with their own learning rate
(``lr * prior_lr_scale``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def is_precision_parameter(name: str) -> bool:
    """``tau`` (anything under a ``prior`` module) or a layer's process noise ``rho``."""
    return ".prior." in f".{name}" or name.endswith(".rho") or name == "rho"


def parameter_groups(
    model: nn.Module, weight_decay: float, lr: float, prior_lr_scale: float
) -> list[dict[str, Any]]:
    """The three AdamW groups (empty groups left out)."""
    decay, no_decay, prior = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_precision_parameter(name):
            prior.append(p)
        elif p.ndim < 2 or "norm" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": prior, "weight_decay": 0.0, "lr": lr * prior_lr_scale},
    ]
    return [g for g in groups if g["params"]]


def warmup_cosine(step: int, warmup_steps: int, cosine: bool, total_steps: int) -> float:
    """Learning-rate factor: linear warm-up, then constant or cosine decay to 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if not cosine:
        return 1.0
    total = max(total_steps - warmup_steps, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, total) / total))


def configure_adamw(
    module: Any,
    model: nn.Module,
    lr: float,
    weight_decay: float,
    prior_lr_scale: float,
    warmup_steps: int,
    cosine: bool,
) -> Any:
    """What a LightningModule's ``configure_optimizers`` returns."""
    opt = torch.optim.AdamW(parameter_groups(model, weight_decay, lr, prior_lr_scale), lr=lr)
    if not warmup_steps and not cosine:
        return opt
    if cosine and not math.isfinite(module.trainer.estimated_stepping_batches):
        raise ValueError(
            "cosine=True decays the learning rate over the whole run, which needs a finite "
            "length: set trainer.max_epochs or trainer.max_steps (not -1)"
        )

    def factor(step: int) -> float:
        total = int(module.trainer.estimated_stepping_batches) if cosine else 0
        return warmup_cosine(step, warmup_steps, cosine, total)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
