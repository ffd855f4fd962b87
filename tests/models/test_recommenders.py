"""SASRec / BERT4Rec with and without BFT: shapes, masking, trimming, causality."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.tasks.recommendation import trim_left_padding

N, L = 40, 8


def left_padded(lengths: list[int], width: int = L + 1) -> torch.Tensor:
    rows = []
    for n in lengths:
        items = torch.randint(1, N + 1, (n,))
        rows.append(torch.cat([torch.zeros(width - n, dtype=torch.long), items]))
    return torch.stack(rows)


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec])
@pytest.mark.parametrize("precision", ["off", "on"])
def test_shapes_and_scores(cls, precision: str) -> None:
    model = cls(N, max_len=L, d_model=16, nhead=2, num_layers=2, precision=precision).eval()
    ids = left_padded([8, 3, 1], L)
    h, lp = model.last_hidden(ids)
    assert h.shape == (3, 16)
    assert (lp is None) == (precision == "off")
    scores = model.score(h, lp)
    assert scores.shape == (3, N + 1) and torch.isneginf(scores[:, 0]).all()
    assert torch.isfinite(scores[:, 1:]).all()
    sub = model.score(h, lp, items=torch.tensor([[1, 2], [3, 4], [5, 6]]))
    torch.testing.assert_close(sub, scores.gather(1, torch.tensor([[1, 2], [3, 4], [5, 6]])))


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec, HSTU])
def test_full_scores_equal_the_product_plus_bias_and_train_it(cls) -> None:
    """All-item scores: ``transform(h) @ W^T + bias`` with column 0 (padding) at -inf,
    and the same gradients (to h, the item table and BERT4Rec's bias) as that formula."""
    torch.manual_seed(0)
    model = cls(N, max_len=L, d_model=16, nhead=2, num_layers=1, precision="off")
    if isinstance(model, BERT4Rec):
        with torch.no_grad():
            model.out_bias.normal_()
    h = torch.randn(5, 16, requires_grad=True)
    target = torch.randint(1, N + 1, (5,))
    got = model.score(h)
    params = [h, *(p for p in model.parameters() if p.requires_grad)]
    grads = torch.autograd.grad(F.cross_entropy(got, target), params, allow_unused=True)
    ref = model.output_transform(h) @ model.item_weights().t() + model.output_bias(None)
    ref = torch.cat([torch.full_like(ref[:, :1], float("-inf")), ref[:, 1:]], dim=1)
    want = torch.autograd.grad(F.cross_entropy(ref, target), params, allow_unused=True)
    torch.testing.assert_close(got, ref)
    for g, w in zip(grads, want, strict=True):
        if w is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w)


def test_full_scores_under_autocast_add_the_bias_in_float32() -> None:
    """Under bf16 autocast the product is bf16, but BERT4Rec's output bias is added
    in float32 after it (inside a bf16 product it would be rounded to bf16)."""
    torch.manual_seed(0)
    model = BERT4Rec(N, max_len=L, d_model=16, nhead=2, num_layers=1, precision="off")
    with torch.no_grad():
        model.out_bias.normal_(0, 20)
    h = torch.randn(5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.score(h)
        product = model.output_transform(h) @ model.item_weights().t()
    assert got.dtype == torch.float32 and torch.isneginf(got[:, 0]).all()
    torch.testing.assert_close(got[:, 1:], (product + model.output_bias(None))[:, 1:])


def test_bft_adds_few_parameters() -> None:
    off = SASRec(N, max_len=L, d_model=16, nhead=2, precision="off")
    on = SASRec(N, max_len=L, d_model=16, nhead=2, precision="on")
    n_off = sum(p.numel() for p in off.parameters())
    n_on = sum(p.numel() for p in on.parameters())
    assert n_on - n_off == (N + 1) + 2 * 2  # tau table (width 1) + rho per layer and group


def test_input_scale_matches_embedding_variance() -> None:
    model = SASRec(N, max_len=L, d_model=64, precision="on")
    # item std 0.02 scaled by sqrt(64): Var ~ 0.0256 (+ positions 0.0004): c ~ 38
    assert 30 < model.input_scale() < 45


def test_bert4rec_masking_rules() -> None:
    model = BERT4Rec(N, max_len=L, d_model=16, nhead=2, mask_prob=0.3)
    seq = left_padded([9, 4, 2, 1])
    inputs, labels, _ = model.train_view({"seq": seq})
    assert inputs.shape == (4, L)
    pad = seq[:, 1:] == 0
    assert (inputs[pad] == 0).all() and (labels[pad] == 0).all()  # padding is never masked
    masked = inputs == model.mask_token
    assert (labels[masked] == seq[:, 1:][masked]).all() and (labels[~masked] == 0).all()
    assert masked.any(dim=1).all()  # every sequence has at least one mask
    ev = model.eval_view(seq[:, 1:])
    assert (ev[:, -1] == model.mask_token).all() and ev.shape == (4, L)


def test_sasrec_labels_skip_padding_inputs() -> None:
    model = SASRec(N, max_len=L)
    seq = left_padded([3])
    inputs, labels, _ = model.train_view({"seq": seq})
    assert ((labels > 0) == (inputs != 0) & (seq[:, 1:] != 0)).all()
    assert int((labels > 0).sum()) == 2


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec])
def test_trimming_padding_is_exact(cls) -> None:
    model = cls(N, max_len=L, d_model=16, nhead=2, precision="on").eval()
    batch = {"input_ids": left_padded([3, 2], L), "target": torch.tensor([1, 2])}
    trimmed = trim_left_padding(batch, keep_one=True)
    assert trimmed["input_ids"].shape[1] == 4
    full = model.score(*model.last_hidden(batch["input_ids"]))
    short = model.score(*model.last_hidden(trimmed["input_ids"]))
    torch.testing.assert_close(full, short, rtol=1e-4, atol=1e-5)


def test_sasrec_is_causal() -> None:
    model = SASRec(N, max_len=L, d_model=16, nhead=2, precision="on").eval()
    ids = left_padded([8], L)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] % N) + 1
    h1, _ = model.encode(ids)
    h2, _ = model.encode(changed)
    torch.testing.assert_close(h1[:, :-1], h2[:, :-1])


def test_frequency_prior_init_orders_tau_by_count() -> None:
    model = SASRec(N, max_len=L, precision="on", prior_init="frequency")
    freq = torch.arange(N + 1)
    model.init_prior_from_frequency(freq)
    log_tau = model.prior.log_tau.weight[1:, 0]
    assert (log_tau.diff() > 0).all()
    assert abs(log_tau.mean().item() - torch.log(torch.tensor(model.input_scale())).item()) < 1e-3


def test_inverse_frequency_control_mirrors_the_frequency_init() -> None:
    freq = torch.arange(N + 1) ** 2
    tables = {}
    for init in ("frequency", "frequency_inverse"):
        torch.manual_seed(0)  # the same weights, so the same input scale c
        model = SASRec(N, max_len=L, precision="on", prior_init=init)
        model.init_prior_from_frequency(freq)
        tables[init] = model.prior.log_tau.weight[1:, 0].clone()
    ordered, inverse = tables["frequency"], tables["frequency_inverse"]
    assert (inverse.diff() < 0).all()  # the rarest id has the highest precision
    # mirrored about the shared mean log c: same spread, same input scale
    torch.testing.assert_close(inverse - inverse.mean(), -(ordered - ordered.mean()))
    torch.testing.assert_close(inverse.mean(), ordered.mean())


def test_shuffled_frequency_control_keeps_values_not_order() -> None:
    freq = torch.arange(N + 1) ** 2
    tables = {}
    for init in ("frequency", "frequency_shuffled"):
        torch.manual_seed(0)
        model = SASRec(N, max_len=L, precision="on", prior_init=init)
        model.init_prior_from_frequency(freq)
        tables[init] = model.prior.log_tau.weight[:, 0].clone()
    ordered, shuffled = tables["frequency"], tables["frequency_shuffled"]
    assert shuffled[0] == ordered[0]  # the padding row stays
    torch.testing.assert_close(shuffled[1:].sort().values, ordered[1:].sort().values)
    assert not torch.equal(shuffled, ordered)
    rank_corr = torch.corrcoef(torch.stack([shuffled[1:].argsort().argsort().float(),
                                            torch.arange(N).float()]))[0, 1]  # fmt: skip
    assert abs(rank_corr) < 0.5


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="num_items"):
        SASRec(0)
    with pytest.raises(ValueError, match="prior"):
        SASRec(N, prior="forest")
    with pytest.raises(ValueError, match="mask_prob"):
        BERT4Rec(N, mask_prob=0.0)
    with pytest.raises(ValueError, match="gain"):
        HSTU(N, precision="on", gain="head")
    with pytest.raises(ValueError, match="key_precision"):
        HSTU(N, precision="on", key_precision=False)
    with pytest.raises(ValueError, match="head='precision' .* needs precision='on'"):
        SASRec(N, head="precision")  # its temperature would never get a gradient
    with pytest.raises(ValueError, match="BERT4Rec needs max_len >= 2"):
        BERT4Rec(N, max_len=1)


def test_inputs_wider_than_max_len_are_refused() -> None:
    """Positions past max_len would all share the first position's embedding."""
    model = SASRec(N, max_len=5)
    with pytest.raises(ValueError, match="input width 8 exceeds max_len=5"):
        model.encode(left_padded([3, 8], width=8))


def test_bert4rec_refuses_prefix_rows() -> None:
    """One row per target would cloze-mask (and train) an early item once per row."""
    batch = {"seq": left_padded([3, 4]), "num_targets": torch.tensor([1, 1])}
    with pytest.raises(ValueError, match="train_rows='user'"):
        BERT4Rec(N).train_view(batch)


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec])
def test_per_head_gain_reaches_every_layer_and_trains(cls) -> None:
    torch.manual_seed(0)
    opts = dict(max_len=8, d_model=16, nhead=2, num_layers=2, precision="on")
    model = cls(30, gain="head", **opts)
    assert all(layer.gain == "head" for layer in model.encoder.layers)
    ids = torch.randint(1, 31, (4, 8))
    h, _ = model.encode(ids)
    h.square().mean().backward()
    assert model.prior.log_tau.weight.grad.abs().sum() > 0  # tau reaches the loss via K_a


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec])
def test_key_precision_ablation_reaches_every_layer_and_trains(cls) -> None:
    torch.manual_seed(0)
    opts = dict(max_len=8, d_model=16, nhead=2, num_layers=2, precision="on")
    model = cls(30, key_precision=False, **opts)
    assert all(not layer.key_precision for layer in model.encoder.layers)
    full = cls(30, **opts)
    full.load_state_dict(model.state_dict())
    ids = torch.randint(1, 31, (4, 8))
    model.eval()
    full.eval()
    h, _ = model.encode(ids)
    assert not torch.allclose(h, full.encode(ids)[0])
    h.square().mean().backward()
    assert model.prior.log_tau.weight.grad.abs().sum() > 0  # tau reaches the loss via K


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec, HSTU])
def test_filter_options_reach_every_layer(cls) -> None:
    """q_init, nu0 and groups given to a recommender set every BFT layer, and change it."""
    torch.manual_seed(0)
    model = cls(30, max_len=8, d_model=16, nhead=2, num_layers=2, precision="on",
                q_init=0.1, nu0=7.0, groups=16).eval()  # fmt: skip
    for layer in model.encoder.layers:
        assert layer.nu0 == 7.0
        assert layer.groups == 16
        torch.testing.assert_close(F.softplus(layer.rho.detach()), torch.full((16,), 0.1))
    ids = torch.randint(1, 31, (3, 8))
    base = cls(30, max_len=8, d_model=16, nhead=2, num_layers=2, precision="on", groups=16)
    base.load_state_dict(model.state_dict())  # same weights (Q0 is a parameter); nu0 = 1
    base.eval()
    same = cls(30, max_len=8, d_model=16, nhead=2, num_layers=2, precision="on", groups=16,
               nu0=7.0).eval()  # fmt: skip
    same.load_state_dict(model.state_dict())
    torch.testing.assert_close(same.encode(ids)[0], model.encode(ids)[0])  # deterministic
    assert not torch.allclose(base.encode(ids)[0], model.encode(ids)[0])  # nu0 matters


@pytest.mark.parametrize("precision", ["off", "on"])
def test_positions_from_start_make_every_prefix_score_as_alone(precision: str) -> None:
    """positions="from_start" indexes items from the row's first one, so the state a
    causal SASRec reads at a prefix's last item equals that prefix's own last state
    (what per-prefix training and the test-time view both see); the default, the
    distance from the row's end, does not."""
    torch.manual_seed(0)
    row = left_padded([6], L)  # (1, L + 1)
    prefix = torch.cat([torch.zeros(1, 3, dtype=torch.long), row[:, :-3]], dim=1)  # first 3
    for positions, same in (("from_start", True), ("from_end", False)):
        model = SASRec(N, max_len=L + 1, d_model=16, nhead=2, precision=precision,
                       positions=positions).eval()  # fmt: skip
        h_row, _ = model.encode(row)
        h_prefix, _ = model.encode(prefix)
        close = torch.allclose(h_row[:, -4], h_prefix[:, -1], rtol=1e-4, atol=1e-5)
        assert close == same, positions
    with pytest.raises(ValueError, match="positions"):
        SASRec(N, positions="middle")


@pytest.mark.parametrize("cls", [SASRec, BERT4Rec, HSTU])
def test_bf16_model_trains_with_its_precision_path_in_float32(cls) -> None:
    """``model.to(torch.bfloat16)`` (Lightning's ``bf16-true``): the model runs forward
    and backward, and the precision path's parameters (layer-0 log tau, rho) and the
    running sill stay float32, where an optimiser step on log tau ~ 8 is not rounded
    away as in bf16."""
    torch.manual_seed(0)
    model = cls(30, max_len=8, d_model=16, nhead=2, num_layers=2, precision="on")
    model = model.to(torch.bfloat16)
    kept = {n: p for n, p in model.named_parameters() if "rho" in n or "log_tau" in n}
    assert kept and all(p.dtype == torch.float32 for p in kept.values())
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if n.endswith("sill"))
    assert model.item_emb.weight.dtype == torch.bfloat16
    before = {n: p.detach().clone() for n, p in kept.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    hidden, _ = model.encode(torch.randint(1, 31, (4, 8)))
    loss = model.score(hidden[:, -1]).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    moved = [n for n, p in kept.items() if p.grad is not None and (p != before[n]).any()]
    assert any("log_tau" in n for n in moved), moved
