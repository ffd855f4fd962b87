"""What a training step adds under DDP: a global mean over targets, and unused parameters.

Only under DDP (``world_size > 1``); a single process returns the loss as it is.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from bft_lightning.nn.hstu import RelativeAttentionBias
from bft_lightning.nn.stats import find_filter_layers


def unused_parameters_anchor(model: nn.Module, timed: bool = True) -> Tensor | float:
    """``0 *`` the parameters the model declares unused, so plain DDP accepts the model.

    A BFT layer whose output precision feeds nothing (the last layer with
    ``head="dot"``, ``predict_noise=False``) keeps its ``rho`` for state-dict
    compatibility but never gets a gradient; DDP without
    ``find_unused_parameters`` stops on such a parameter. Its gradient
    becomes 0, and AdamW leaves it where it is (rho is never decayed), so
    the weights are those of one process. Likewise HSTU's time-bucket weights
    when the batch has no timestamps (``timed=False``: S3-Rec-format data).
    """
    unused = [
        rho
        for _, layer in find_filter_layers(model)
        if getattr(layer, "predict_noise", True) is False
        and isinstance(rho := getattr(layer, "rho", None), torch.nn.Parameter)
        and rho.requires_grad
    ]
    if not timed:
        unused += [
            m.time_weight
            for m in model.modules()
            if isinstance(m, RelativeAttentionBias) and m.time_weight.requires_grad
        ]
    return sum((p.sum() * 0.0 for p in unused), 0.0)


def global_mean(loss: Tensor, count: Tensor, trainer: object, model: nn.Module,
                timed: bool = True) -> Tensor:  # fmt: skip
    """Rescale a per-process mean so DDP's gradient average is the mean over all targets
    (or rows: ``count`` is what ``loss`` is a mean over).

    DDP averages gradients over processes; processes with different target
    counts would weigh a target by ``1 / (N * its process's count)``. Scaling
    by ``N * count / total`` weighs every target by ``1 / total``, as one
    process with the whole global batch does (one all-reduce of a scalar).
    ``trainer`` is the task's trainer or None.
    """
    world = getattr(trainer, "world_size", 1) if trainer is not None else 1
    if world <= 1:
        return loss
    count = count.detach().to(loss.dtype)
    total = trainer.strategy.reduce(count.clone(), reduce_op="sum")  # type: ignore[attr-defined]
    anchor = unused_parameters_anchor(model, timed)
    return loss * (count * world / total.clamp_min(1)) + anchor
