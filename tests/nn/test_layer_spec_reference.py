"""A whole BFT encoder layer against a float64 reference written from docs/spec.md.

The reference is deliberately naive: explicit loops over (batch, head, query), the
delta rules as per-block sums of squared weights, the REML variance with its sill
prior, the Kalman update and the predict step with the FFN Jacobian's diagonal from
the textbook GELU derivative. It shares nothing with the library but the layer's
weights, so a slip in any fused or pooled computation shows up here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bft_lightning.nn import functional as BF
from bft_lightning.nn.layers import BFTEncoderLayer
from bft_lightning.nn.stats import set_recording

B, T, D, H, G, FF = 2, 5, 8, 2, 4, 12
DH = D // H


def _delta_matrix(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """P[r, c] = mean over the r-th block's output rows of the summed squared weights of
    the c-th block's input columns (the spec's pooled delta rule)."""
    out, inp = w.shape[0] // rows, w.shape[1] // cols
    return torch.stack(
        [
            torch.stack(
                [
                    (w[r * out : (r + 1) * out, c * inp : (c + 1) * inp] ** 2).sum(1).mean()
                    for c in range(cols)
                ]  # fmt: skip
            )
            for r in range(rows)
        ]
    )


def reference(layer: BFTEncoderLayer, h, lp, blocked):
    valid = torch.isfinite(lp).any(-1)  # (B, T)
    lam = torch.where(valid[..., None], lp.exp(), torch.zeros_like(lp))
    ln1, ln2 = layer.norm1, layer.norm2
    sig1 = ((h - h.mean(-1, keepdim=True)) ** 2).mean(-1).add(ln1.eps).sqrt()
    w_qkv, b_qkv = layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias
    q, k, v = (y.view(B, T, H, DH) for y in (ln1(h) @ w_qkv.T + b_qkv).chunk(3, -1))
    # observe: the keys' precision through Norm1 and W_V (delta rule) as a logit bias
    p_v = _delta_matrix(w_qkv[2 * D :] * ln1.weight, H, G)  # (H, G)
    s2_in = torch.where(valid[..., None], 1 / lam.clamp_min(1e-300), 0.0) / sig1[..., None] ** 2
    lbar = 1 / (s2_in @ p_v.T)  # (B, T, H)
    allowed = valid[:, None, :].expand(B, T, T) & ~blocked
    e = h.new_zeros(B, H, T, DH)
    spread, n_eff = h.new_zeros(B, H, T), h.new_zeros(B, H, T)
    for b in range(B):
        for a in range(H):
            for t in range(T):
                js = [j for j in range(T) if allowed[b, t, j]]
                if not js:
                    continue
                score = torch.stack([q[b, t, a] @ k[b, j, a] / math.sqrt(DH) for j in js])
                w = torch.exp(score) * lbar[b, js, a]
                w = w / w.sum()
                e[b, a, t] = (w[:, None] * v[b, js, a]).sum(0)
                spread[b, a, t] = (w * ((v[b, js, a] - e[b, a, t]) ** 2).sum(-1)).sum() / DH
                n_eff[b, a, t] = 1 / (w**2).sum()
    has_key = allowed.any(-1)  # (B, T)
    s0, nu0 = layer.sill.view(1, H, 1), layer.nu0
    sigma2 = (nu0 * s0 + n_eff * spread) / (nu0 + n_eff - 1)  # REML with the sill prior
    lobs_head = torch.where(has_key[:, None], n_eff / sigma2, 0.0)  # (B, H, T)
    p_o = _delta_matrix(layer.self_attn.out_proj.weight, G, H)  # (G, H)
    s2_z = (1 / lobs_head.transpose(1, 2).clamp_min(1e-300)) @ p_o.T
    lobs = torch.where(has_key[..., None], 1 / s2_z, 0.0)  # (B, T, G)
    # update: Kalman gain and posterior precision (precision 0 is absorbing)
    gain = torch.where(has_key[..., None], lobs / (lam + lobs), 0.0)
    z = layer.self_attn.out_proj(e.permute(0, 2, 1, 3).reshape(B, T, D))
    h1 = h + gain.repeat_interleave(D // G, -1) * z
    lam1 = (lam + lobs) * (lam > 0)
    # predict: J-bar from the FFN Jacobian's diagonal over Norm2, process noise Q
    sig2 = ((h1 - h1.mean(-1, keepdim=True)) ** 2).mean(-1).add(ln2.eps).sqrt()
    a = ln2(h1) @ layer.linear1.weight.T + layer.linear1.bias
    dphi = torch.special.ndtr(a) + a * torch.exp(-(a**2) / 2) / math.sqrt(2 * math.pi)
    w1, w2 = layer.linear1.weight, layer.linear2.weight
    diag = (ln2.weight / sig2[..., None]) * torch.einsum("ik,btk,ki->bti", w2, dphi, w1)
    jbar = diag.view(B, T, G, -1).mean(-1)
    q_noise = F.softplus(layer.rho)
    lam2 = torch.where(lam1 > 0, 1 / ((1 + jbar) ** 2 / lam1.clamp_min(1e-300) + q_noise), 0.0)
    h2 = h1 + layer.linear2(F.gelu(a))
    return dict(valid=valid, has_key=has_key, n_eff=n_eff, lobs=lobs, gain=gain, lam1=lam1,
                jbar=jbar, lam2=lam2, h2=h2)  # fmt: skip


@pytest.mark.parametrize("attention_impl", ["reference", "chunked"])
def test_layer_equals_the_spec_written_out(attention_impl: str) -> None:
    torch.manual_seed(0)
    layer = BFTEncoderLayer(D, H, FF, dropout=0.0, activation="gelu", groups=G, q_init=0.05,
                            attention_impl=attention_impl).double().eval()  # fmt: skip
    with torch.no_grad():  # away from the initial weights, and a sill that is not 1
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
        layer.sill.copy_(torch.tensor([0.7, 1.3]))
    h = torch.randn(B, T, D, dtype=torch.float64)
    lp = 1.5 * torch.randn(B, T, G, dtype=torch.float64)
    lp[0, 0] = float("-inf")  # left padding in row 0, right padding in row 1
    lp[1, 4] = float("-inf")
    blocked = torch.zeros(T, T, dtype=torch.bool)
    blocked[2, :] = True  # a valid query that may read no key
    set_recording(layer, True)
    out_h, out_lp = layer(h, lp, attn_mask=blocked)
    st = layer.last_stats
    ref = reference(layer, h, lp, blocked)
    valid, has_key = ref["valid"], ref["has_key"]
    close = dict(rtol=1e-5, atol=1e-6)  # the layer records its statistics in float32
    torch.testing.assert_close(st.n_eff.double()[has_key], ref["n_eff"].transpose(1, 2)[has_key])
    torch.testing.assert_close(
        st.log_prec_obs.double()[has_key], ref["lobs"].log()[has_key], **close
    )
    torch.testing.assert_close(st.gain.double()[valid], ref["gain"][valid], **close)
    assert (st.gain[:, 2] == 0).all()  # no key: no update
    torch.testing.assert_close(st.log_prec_post.double()[valid], ref["lam1"].log()[valid], **close)
    torch.testing.assert_close(st.jbar.double()[valid], ref["jbar"][valid], **close)
    torch.testing.assert_close(out_lp[valid], ref["lam2"].log()[valid], **close)
    assert torch.isneginf(out_lp[~valid]).all()
    torch.testing.assert_close(out_h[valid], ref["h2"][valid], **close)
    kept = out_lp.detach()[valid]
    assert BF.LOG_PREC_MIN <= float(kept.min()) <= float(kept.max()) <= BF.LOG_PREC_MAX
