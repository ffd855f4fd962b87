"""The filter's pure functions: delta rule, spread, REML, gain, predict; gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from bft_lightning.nn import functional as BF
from bft_lightning.nn import jacobian as J
from bft_lightning.nn.functional import masked_softmax


def test_delta_rule_matches_monte_carlo() -> None:
    torch.manual_seed(1)
    w = torch.randn(6, 4)
    s2_in = torch.tensor([0.5, 2.0])  # two input groups of 2 channels
    p = BF.delta_rule_matrix(w, out_groups=3, in_groups=2)
    x = torch.randn(200_000, 4) * s2_in.repeat_interleave(2).sqrt()
    var_out = (x @ w.t()).var(dim=0)  # per output channel
    expected = var_out.view(3, 2).mean(dim=1)
    torch.testing.assert_close(BF.delta_rule(s2_in, p), expected, rtol=0.03, atol=0.0)


def test_delta_rule_norm_scale_folds_into_weight() -> None:
    w, gamma = torch.randn(4, 4), torch.rand(4) + 0.5
    p1 = BF.delta_rule_matrix(w, 2, 4, in_scale=gamma)
    p2 = BF.delta_rule_matrix(w * gamma, 2, 4)
    torch.testing.assert_close(p1, p2)


def test_expanded_square_equals_explicit_spread() -> None:
    b, h, t, dh = 2, 3, 5, 4
    v = torch.randn(b, h, t, dh, dtype=torch.float64)
    p = torch.softmax(torch.randn(b, h, t, t, dtype=torch.float64), dim=-1)
    e = p @ v
    second = p @ v.square().mean(-1, keepdim=True)
    spread = BF.expanded_square_spread(second.squeeze(-1), e).double()
    explicit = (p * (v.unsqueeze(2) - e.unsqueeze(3)).square().mean(-1)).sum(-1)
    torch.testing.assert_close(spread, explicit, rtol=1e-5, atol=1e-6)


def test_n_eff_from_lse_matches_row_reduction() -> None:
    s = torch.randn(3, 7, dtype=torch.float64)
    p = torch.softmax(s, -1)
    direct = BF.kish_n_eff(p.square().sum(-1))
    lse = BF.n_eff_from_lse(torch.logsumexp(2 * s, -1), torch.logsumexp(s, -1))
    torch.testing.assert_close(direct, lse)
    assert (direct >= 1).all() and (direct <= 7 + 1e-9).all()


def test_reml_limits() -> None:
    sill = torch.tensor([2.0])
    # one neighbour (a sink): no residual degrees of freedom, the prior decides
    one = BF.reml_variance(torch.zeros(1, 1, 1), torch.ones(1, 1, 1), sill, nu0=1.0)
    torch.testing.assert_close(one, torch.full((1, 1, 1), 2.0))
    # many agreeing neighbours: the data dominate
    many = BF.reml_variance(torch.full((1, 1, 1), 0.1), torch.full((1, 1, 1), 1e4), sill)
    assert abs(many.item() - 0.1) < 1e-3


def test_observation_precision_matches_the_delta_rule_and_is_clamped() -> None:
    """lambda_obs per head = n_eff / sigma2, to groups through W_O by the delta rule
    (variances add with P_O's weights), then clamped to [-20, 20] like every log
    precision: a near-zero spread must not give log lambda_obs of 80."""
    sigma2 = torch.tensor([[[0.5, 2.0]], [[1e-35, 1e-35]]]).transpose(1, 2)  # (2, H=2, T=1)
    n_eff = torch.tensor([[[2.0, 4.0]], [[3.0, 3.0]]]).transpose(1, 2)
    has_key = torch.ones(2, 1, dtype=torch.bool)
    p_o = torch.tensor([[0.25, 0.75], [1.0, 0.0]])  # (G=2, H=2)
    lp = BF.observation_log_precision(sigma2, n_eff, has_key, p_o)  # (2, 1, 2)
    s2 = torch.tensor([0.25 * 0.5 / 2 + 0.75 * 2.0 / 4, 0.5 / 2])
    torch.testing.assert_close(lp[0, 0], -torch.log(s2))
    assert (lp[1] == BF.LOG_PREC_MAX).all()


def test_kalman_gain_range_and_empty_rows() -> None:
    lp = torch.randn(2, 5, 3) * 5
    lp_obs = torch.randn(2, 5, 3) * 5
    has = torch.ones(2, 5, dtype=torch.bool)
    has[1, 0] = False
    k = BF.kalman_gain(lp, lp_obs, has)
    assert (k >= 0).all() and (k <= 1).all()
    assert (k[1, 0] == 0).all()
    lam, lam_obs = lp.exp(), lp_obs.exp()
    torch.testing.assert_close(k[0], (lam_obs / (lam + lam_obs))[0])


def test_predict_bounded_by_inverse_q() -> None:
    lp = torch.randn(4, 6, 2) * 8
    jbar = torch.randn(4, 6, 2)
    q = torch.tensor([0.01, 0.5])
    out = BF.predict_log_precision(lp, jbar, q)
    assert (out.exp() <= 1 / q + 1e-3).all()


def test_masked_softmax_empty_row_is_zero() -> None:
    s = torch.randn(2, 4)
    allowed = torch.tensor([[True, False, True, False], [False] * 4])
    p = masked_softmax(s, allowed)
    assert torch.isfinite(p).all()
    assert p[1].abs().sum() == 0
    torch.testing.assert_close(p[0].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_masked_softmax_equals_a_fill_with_minus_inf(dtype) -> None:
    """Bit for bit the weights of a fill of the blocked entries with -inf (and all
    zeros for a row with no key), for a mask broadcast over heads and large
    scores; gradients through an empty row are 0, not NaN."""
    g = torch.Generator().manual_seed(0)
    scale = 1e4 if dtype == torch.float16 else 1e6  # float16 ends at 65504
    s = (torch.randn(3, 2, 5, 7, generator=g) * scale).to(dtype).requires_grad_()
    allowed = torch.rand(3, 1, 5, 7, generator=g) > 0.5
    allowed[0, 0, 1] = False  # a row with no key
    p = masked_softmax(s, allowed)
    has_key = allowed.any(-1, keepdim=True)
    want = torch.softmax(s.detach().masked_fill(~allowed, float("-inf")), dim=-1)
    want = torch.where(has_key, want, torch.zeros_like(want))
    assert torch.equal(p.detach(), want)
    p.sum().backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()
    assert (s.grad[0, :, 1] == 0).all()


def test_gradcheck_functional_pieces() -> None:
    d = torch.float64
    lp = torch.randn(2, 3, 2, dtype=d, requires_grad=True)
    sig = (torch.rand(2, 3, dtype=d) + 0.5).requires_grad_()
    p_v = (torch.rand(2, 2, dtype=d) + 0.1).requires_grad_()
    assert torch.autograd.gradcheck(BF.neighbour_log_precision, (lp, sig, p_v))

    spread = (torch.rand(2, 2, 3, dtype=d) + 0.1).requires_grad_()
    n_eff = (torch.rand(2, 2, 3, dtype=d) * 3 + 1).requires_grad_()
    sill = (torch.rand(2, dtype=d) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda s, n, s0: BF.reml_variance(s, n, s0), (spread, n_eff, sill)
    )

    lp_obs = torch.randn(2, 3, 2, dtype=d, requires_grad=True)
    has = torch.ones(2, 3, dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda a, b: BF.kalman_gain(a, b, has), (lp, lp_obs))
    assert torch.autograd.gradcheck(lambda a, b: BF.update_log_precision(a, b, has), (lp, lp_obs))

    jbar = (torch.randn(2, 3, 2, dtype=d) * 0.3).requires_grad_()
    q = (torch.rand(2, dtype=d) * 0.1 + 0.01).requires_grad_()
    assert torch.autograd.gradcheck(BF.predict_log_precision, (lp, jbar, q))

    e = torch.randn(2, 2, 3, 4, dtype=d, requires_grad=True)
    second = (e.detach().square().mean(-1) + 1.0).requires_grad_()
    assert torch.autograd.gradcheck(BF.expanded_square_spread, (second, e))


def test_ffn_jacobian_matches_autograd_diagonal() -> None:
    torch.manual_seed(3)
    d, f, g = 8, 16, 4
    ln = torch.nn.LayerNorm(d)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    lin1, lin2 = torch.nn.Linear(d, f), torch.nn.Linear(f, d)
    h = torch.randn(d)
    jac = torch.autograd.functional.jacobian(
        lambda x: lin2(torch.nn.functional.gelu(lin1(ln(x)))), h
    )
    m = J.ffn_jacobian_matrix(lin1.weight, lin2.weight, ln.weight, g)
    a = lin1(ln(h))
    jbar = J.activation_with_jacobian(a.view(1, 1, f), m, "gelu")[1] / BF.norm_sigma(
        h.view(1, 1, d), ln.eps
    ).unsqueeze(-1)
    # the spec's diagonal ignores LayerNorm's centring/normalising projection terms,
    # whose share of the diagonal is O(1/d); compare on the leading term
    sigma = BF.norm_sigma(h.view(1, 1, d), ln.eps).item()
    leading = (
        torch.einsum(
            "ik,k,ki,i->i", lin2.weight, J.activation_derivative(a, "gelu"), lin1.weight, ln.weight
        )
        / sigma
    )
    torch.testing.assert_close(jbar.view(g), leading.view(g, -1).mean(1), rtol=1e-5, atol=1e-6)
    # and the leading term is the dominant part of the true diagonal
    corr = torch.corrcoef(torch.stack([jac.diagonal(), leading]))[0, 1]
    assert corr > 0.8


def test_gelu_derivative_matches_autograd_and_gradchecks() -> None:
    a = torch.linspace(-4, 4, 41, dtype=torch.float64, requires_grad=True)
    (auto,) = torch.autograd.grad(torch.nn.functional.gelu(a).sum(), a, create_graph=True)
    torch.testing.assert_close(J.activation_derivative(a, "gelu"), auto)
    assert torch.autograd.gradcheck(lambda x: J.activation_derivative(x, "gelu"), (a,))


def test_autograd_backward_equals_the_hand_written_functions() -> None:
    """``backward="autograd"`` (plain ops, for torch.compile: inductor on CUDA gave zero
    gradients through the hand-written Functions) and ``"custom"`` give the same
    values and gradients, through really different graphs."""
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    m = torch.randn(8, 2, dtype=torch.float64)
    pieces = {
        "norm_sigma": lambda t, b: BF.norm_sigma(t, 1e-5, backward=b),
        "gelu jacobian": lambda t, b: J.activation_with_jacobian(t, m, "gelu", b)[1],
    }
    for name, fn in pieces.items():
        results = []
        for backward in ("custom", "autograd"):
            leaf = x.clone().requires_grad_()
            out = fn(leaf, backward)
            weight = torch.randn(
                out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(0)
            )
            (grad,) = torch.autograd.grad((out * weight).sum(), leaf)
            results.append((out.detach(), grad, out.grad_fn.name()))
        (v0, g0, f0), (v1, g1, f1) = results
        assert f0 != f1, (name, f0)  # the two paths really differ
        torch.testing.assert_close(v1, v0, msg=name)
        torch.testing.assert_close(g1, g0, msg=name)
    with pytest.raises(ValueError, match="backward must be one of"):
        J.activation_with_jacobian(x, m, "gelu", "traced")


def _assert_keeps_only_a(call, a: torch.Tensor) -> None:
    """Of the tensors ``call`` saves for its backward with as many elements as ``a``
    or more (in any shape or dtype), ``a`` is the only one."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        call()
    big = [t for t in saved if t.numel() >= a.numel()]
    assert len(big) == 1 and big[0] is a


@pytest.mark.parametrize("backward", ["custom", "autograd"])
@pytest.mark.parametrize("block", [None, 36])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_activation_with_jacobian_equals_separate_ops(
    activation: str, block: int | None, backward: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """phi(a) and phi'(a) @ M from one Function: the values and gradients of the
    activation and the Jacobian product computed apart (float64, gradcheck), also
    when only one of the two outputs is used; with ``block`` the GELU path works
    in row blocks of 3 rows (10 rows: blocks 3, 3, 3, 1), as on a CPU at scale."""
    if block is not None:
        monkeypatch.setattr(J, "_BLOCK_ELEMENTS", block)
    a = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    m = torch.randn(12, 3, dtype=torch.float64, requires_grad=True)
    act, jac = J.activation_with_jacobian(a, m, activation, backward)
    a2, m2 = a.detach().clone().requires_grad_(), m.detach().clone().requires_grad_()
    phi = torch.nn.functional.gelu if activation == "gelu" else torch.nn.functional.relu
    if activation == "gelu":  # the textbook formula, independent of the library's paths
        dphi = torch.special.ndtr(a2) + a2 * torch.exp(-0.5 * a2 * a2) / math.sqrt(2 * math.pi)
    else:
        dphi = (a2 > 0).to(a2.dtype)
    act2, jac2 = phi(a2), dphi @ m2
    torch.testing.assert_close(act, act2, rtol=0, atol=0)
    torch.testing.assert_close(jac, jac2)
    w1, w2 = torch.randn_like(act), torch.randn_like(jac)
    for use in ("both", "act", "jac"):

        def loss(x, y, use=use):  # an output left out is not in the graph at all
            if use == "act":
                return (x * w1).sum()
            if use == "jac":
                return (y * w2).sum()
            return (x * w1).sum() + (y * w2).sum()

        got = torch.autograd.grad(loss(act, jac), (a, m), retain_graph=True, allow_unused=True)
        want = torch.autograd.grad(loss(act2, jac2), (a2, m2), retain_graph=True, allow_unused=True)
        for g, r in zip(got, want, strict=True):
            if r is None:  # unused by the plain ops: zero or None here
                assert g is None or not g.any(), use
            else:
                torch.testing.assert_close(g, r, msg=use)
    if activation == "gelu":
        assert torch.autograd.gradcheck(
            lambda x, y: J.activation_with_jacobian(x, y, "gelu", backward), (a, m)
        )
    if activation == "gelu" and backward == "custom":
        _assert_keeps_only_a(lambda: J.activation_with_jacobian(a, m, activation), a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pad_value", [0.0, 7.0, float("inf"), float("nan")])
def test_running_sill_update_is_the_valid_values_variance(pad_value: float, dtype) -> None:
    """The sill moves toward the per-head variance of the valid values only
    (``mean ||v_j - mean v||^2 / d_h`` over valid positions, float64 reference),
    whatever the values at padded positions hold, non-finite ones included; the
    values themselves are left as they were."""
    torch.manual_seed(0)
    b, h, t, dh = 3, 2, 7, 4
    scale = torch.tensor([1.0, 3.0], dtype=dtype).view(1, 1, h, 1)
    base = torch.randn(b, t, h, dh, dtype=dtype) * scale + 0.5
    values = base.transpose(1, 2)  # (B, H, T, d_h) as a view, as the layers pass it
    valid = torch.rand(b, t) > 0.3
    valid[0, 0] = False
    values[0, :, 0] = pad_value
    before = values.clone()
    if dtype == torch.float64:  # the mask in any layout (a transposed one, as a caller may pass)
        valid = valid.t().contiguous().t()
    v = values.transpose(1, 2)[valid].double()  # (N, H, d_h)
    want_var = (v - v.mean(dim=0)).square().sum(dim=(0, 2)) / (v.shape[0] * dh)
    sill = torch.ones(h, dtype=dtype)
    BF.update_running_sill_(sill, values, valid, momentum=0.25)
    torch.testing.assert_close(sill.double(), 0.75 + 0.25 * want_var, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values, before, equal_nan=True, rtol=0, atol=0)
