"""The faiss item index: its lists against the exact tiled ones (recall, scores, exclusion,
log-sum-exp), the bias and per-user scale folded in, and the digest check of a saved index."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("faiss")

from bft_lightning.models import BERT4Rec, SASRec  # noqa: E402
from bft_lightning.retrieval import topk  # noqa: E402
from bft_lightning.retrieval.faiss_index import (  # noqa: E402
    FaissConfig,
    ItemIndex,
    StaleIndexError,
)


def _model(cls: type, items: int, **opts: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = cls(items, 8, d_model=32, nhead=2, num_layers=1, dim_feedforward=32, **opts).eval()
    with torch.no_grad():  # clustered items, as trained tables are: neighbours matter
        centres = torch.randn(50, 32)
        rows = model.item_emb.weight.shape[0]  # BERT4Rec's holds its mask token too
        table = centres[torch.randint(0, 50, (rows,))] + 0.5 * torch.randn(rows, 32)
        model.item_emb.weight.copy_(table)
    return model


def _states(model: torch.nn.Module, users: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(1, model.num_items + 1, (users, 8))
    with torch.no_grad():
        return model.last_hidden(ids)


def _recall(a: torch.Tensor, b: torch.Tensor) -> float:
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / a.numel()


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
@pytest.mark.parametrize("case", ["sasrec-precision-head", "bert4rec-bias"])
def test_faiss_lists_match_the_exact_ones(kind: str, case: str) -> None:
    """Recall@10 >= 0.99 against the tiled top-k, the found items' scores are the model's,
    excluded items never come back: with BERT4Rec's item bias and the precision head's
    per-user scale folded into the index and the query."""
    if case.startswith("sasrec"):
        model = _model(SASRec, 3000, precision="on", head="precision")
        with torch.no_grad():  # per-user scales far from 1
            model.temperature.weight.normal_(0, 0.5)
    else:
        model = _model(BERT4Rec, 3000)
        with torch.no_grad():  # a bias that matters for the ranking
            model.out_bias.copy_(torch.randn_like(model.out_bias) * 3)
    hidden, log_prec = _states(model, 64)
    index = ItemIndex.build(model, FaissConfig(kind=kind, nlist=64, nprobe=16))
    exclude = torch.randint(0, 3001, (64, 6))
    exact = topk(model, hidden, log_prec, 10, exclude)
    approx = topk(model, hidden, log_prec, 10, exclude, index=index)
    assert _recall(approx.ids, exact.ids) >= 0.99
    assert not (approx.ids.unsqueeze(2) == exclude.unsqueeze(1)).any()
    # where an item is in both lists it has the same score: the index's scores are exact
    same = approx.ids == exact.ids
    torch.testing.assert_close(approx.scores[same], exact.scores[same], rtol=1e-5, atol=1e-5)
    assert (approx.scores[:, :-1] >= approx.scores[:, 1:]).all()


def test_logsumexp_exact_with_a_full_sample_and_close_with_a_part() -> None:
    model = _model(SASRec, 2000)
    hidden, log_prec = _states(model, 16)
    exclude = torch.randint(0, 2001, (16, 5))
    exact = topk(model, hidden, log_prec, 10, exclude)
    full = ItemIndex.build(model, FaissConfig(lse_sample=4096))  # 2,000 items: all sampled
    got = topk(model, hidden, log_prec, 10, exclude, index=full)
    torch.testing.assert_close(got.logsumexp, exact.logsumexp, rtol=0, atol=1e-4)
    part = ItemIndex.build(model, FaissConfig(lse_sample=500))
    estimate = topk(model, hidden, log_prec, 10, exclude, index=part).logsumexp
    assert (estimate - exact.logsumexp).abs().max() < 0.1  # a sampled estimate of the tail


def test_saved_index_is_checked_by_digest(tmp_path) -> None:
    model = _model(SASRec, 500)
    path = tmp_path / "items.faiss"
    ItemIndex.build(model, FaissConfig(kind="ivf", nlist=8)).save(path)
    loaded = ItemIndex.load(path, model)
    hidden, log_prec = _states(model, 4)
    assert torch.equal(topk(model, hidden, log_prec, 5, index=loaded).ids,
                       topk(model, hidden, log_prec, 5).ids)  # fmt: skip
    assert loaded.config.kind == "ivf"
    with torch.no_grad():
        model.item_emb.weight[7, 0] += 1e-3  # one weight of one item changed
    with pytest.raises(StaleIndexError, match=r"items\.faiss: the index was built from other"):
        ItemIndex.load(path, model)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        FaissConfig(kind="flat")
    with pytest.raises(ValueError, match="ef_search must be an integer >= 1"):
        FaissConfig(ef_search=0)
