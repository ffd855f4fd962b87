"""Calibration of a pretrained LM's filter (``docs/spec.md``, Calibration of a pretrained LM).

:func:`calibrate_precision` sets the prior ``tau``, ``Q`` and the sill on one
batch so that BFT starts near the pretrained model (median gain ``target_gain``
in every layer, layer-0 attention exactly softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bft_lightning.nn import functional as BF
from bft_lightning.nn.stats import FilterStats, find_filter_layers

if TYPE_CHECKING:
    from bft_lightning.lm.model import LlamaForCausalLM


def _inverse_softplus(q: Tensor) -> Tensor:
    q = q.clamp_min(1e-12)
    return torch.where(q > 20, q, torch.log(torch.expm1(q)))


@dataclass
class CalibrationReport:
    """Median gain per layer (one row per layer, one value per group) after calibration."""

    median_gain: list[list[float]] = field(default_factory=list)
    log_c: list[float] = field(default_factory=list)
    q: list[list[float]] = field(default_factory=list)


@torch.no_grad()
def calibrate_precision(
    model: LlamaForCausalLM,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    target_gain: float = 0.9,
    iterations: int = 3,
) -> CalibrationReport:
    """Set the prior, ``Q`` and the sill so BFT starts near the pretrained model.

    A pretrained model is the case ``K = 1`` with softmax attention. The rule,
    with ``r = target_gain / (1 - target_gain)`` (the odds ``lambda_obs / lambda``
    that give ``K = target_gain``), on one batch of real inputs:

    - sill ``s0^2``: each layer's value variance on the batch (not 1);
    - layer 0: ``log tau_i = log c - 2 log rms(e_i)``, uniform in RMSNorm
      units, so layer-0 attention stays exactly softmax; ``log c`` per group
      is ``median_t(log lambda_obs_t + 2 log rms(e_{id_t})) - log r``;
    - layer ``l >= 1``: ``1 / lambda_l = (1 + Jbar)^2 / lambda'_{l-1} + Q_{l-1}``,
      so ``Q_{l-1} = median_t(r / lambda_obs_{l,t} - (1 + Jbar_t)^2 / lambda'_{l-1,t})``
      (floored at ``1e-6 r / median lambda_obs``): the median token of every
      layer has ``K ~ target_gain``.

    Each layer's attention depends on the precision it receives, so the rule
    is applied ``iterations`` times. ``Q`` comes out large (``~ r / lambda_obs``),
    which makes ``lambda`` nearly uniform: the deliberate opposite of the
    from-scratch ``Q0 = 0.01``, whose accumulated precision would drive ``K``
    towards ``1 / (l + 1)`` in layer ``l`` and change a pretrained model's
    function. What remains different from softmax is the key bias
    ``2 log rms(h_j)`` of layers ``>= 1`` (a high-norm sink token gets more
    weight); training moves ``tau`` and ``Q`` from there.
    """
    body = model.model
    if body.prior is None:
        raise ValueError("calibrate_precision needs precision='on'")
    if not 0.0 < target_gain < 1.0:
        raise ValueError(f"target_gain must be in (0, 1), got {target_gain}")
    layers = body.decoder_layers
    log_r = math.log(target_gain / (1.0 - target_gain))
    training = model.training
    saved = [(layer.record, layer.record_attention) for _, layer in find_filter_layers(model)]
    model.eval()
    emb = body.embed_tokens.weight
    log_rms2 = 2.0 * torch.log(BF.norm_sigma(emb[None], model.config.rms_norm_eps, True))[0]
    prior_w = body.prior.log_tau.weight
    for layer in layers:
        layer.record, layer.record_attention = True, False
    report = CalibrationReport()
    try:
        for _ in range(iterations):
            for layer in layers:
                layer.calibrate_sill = True
            model(input_ids, attention_mask)  # sets each layer's sill from this batch ...
            for layer in layers:
                layer.calibrate_sill = False
                layer.flush_sill()
            # ... which the statistics fitted below must use: a second forward (the
            # first one's statistics were made with the previous sill, 1 at the start)
            model(input_ids, attention_mask)
            stats: list[FilterStats] = [layer.last_stats for layer in layers]  # type: ignore[misc]
            s0 = stats[0]
            x = s0.log_prec_obs[s0.valid] + log_rms2[input_ids[s0.valid]].unsqueeze(1)  # (N, G)
            log_c = x.median(dim=0).values - log_r  # (G,)
            if prior_w.shape[1] == 1:
                log_c = x.median().reshape(1) - log_r
            report.log_c = log_c.tolist()
            prior_w.copy_((log_c.unsqueeze(0) - log_rms2.unsqueeze(1)).to(prior_w.dtype))
            for i in range(1, len(layers)):
                s, prev = stats[i], stats[i - 1]
                var_obs = torch.exp(-s.log_prec_obs[s.valid])  # (N, G)
                carried = (1.0 + prev.jbar[prev.valid]).square() * torch.exp(
                    -prev.log_prec_post[prev.valid]
                )
                need = (var_obs * math.exp(log_r) - carried).median(dim=0).values
                floor = 1e-6 * math.exp(log_r) * var_obs.median(dim=0).values
                rho = layers[i - 1].rho
                assert rho is not None
                rho.copy_(_inverse_softplus(torch.maximum(need, floor)).to(rho.dtype))
        model(input_ids, attention_mask)
        for layer in layers:
            st = layer.last_stats
            assert st is not None
            report.median_gain.append(st.gain[st.valid].median(dim=0).values.tolist())
            report.q.append(st.q.tolist())
    finally:
        for (_, recorder), (rec, rec_attn) in zip(find_filter_layers(model), saved):
            recorder.record, recorder.record_attention = rec, rec_attn
            if not rec:
                recorder.last_stats = None
        model.train(training)
    return report
