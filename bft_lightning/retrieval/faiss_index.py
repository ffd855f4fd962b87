"""An approximate item index (faiss) whose ranking is the model's, for large catalogues.

The model scores item ``j`` for a user as ``s_u (u . v_j + b_j)``: ``u`` the
transformed state, ``v_j`` the item's output embedding, ``b_j`` its bias (0
when the model has none) and ``s_u > 0`` the per-user factor of
``head="precision"`` (1 otherwise). The index turns this into a
nearest-neighbour search in L2 (the maximum-inner-product reduction):

    item  x_j = [v_j, b_j, sqrt(R^2 - |v_j|^2 - b_j^2)]    (R = max_j |[v_j, b_j]|)
    query q_u = s_u [u, 1, 0]
    |q_u - x_j|^2 = |q_u|^2 + R^2 - 2 s_u (u . v_j + b_j)

so the nearest items are the best scored, the bias and the per-user factor
folded into the index and the query. The IVF index searches that L2 form
(its k-means cells are L2 cells); the HNSW graph searches the inner product
``q_u . x_j`` itself, the same ranking, where an item far from the others (a
large bias) is not left out of the graph's neighbourhoods. The candidates found (``k`` plus the
user's excluded items plus ``extra``, "fetch more than k and filter") are then
scored exactly as the tiled path scores them (``Scorer.columns``: the returned
scores are the model's scores), excluded items dropped, and the best ``k``
kept. The approximation is only in which items are found.

The log-sum-exp over all items (the softmax confidence) is not available
without scoring every item; the index gives the exact sum over its candidates
plus an unbiased estimate of the rest from a fixed uniform sample of
``lse_sample`` items (``N / m`` times their sum, candidates and excluded items
counted as zero). ``docs/serving.md`` gives its measured error.

Two index kinds (measured at 1M items in ``results/perf/serving.md``):
``hnsw`` (graph; slow to build, fast and accurate to search) and ``ivf``
(``nlist`` k-means cells, ``nprobe`` scanned per query; fast to build).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender
from bft_lightning.retrieval.scores import Scorer

__all__ = ["FaissConfig", "ItemIndex", "StaleIndexError", "item_digest"]

KINDS = ("hnsw", "ivf")


class StaleIndexError(ValueError):
    """A saved index that was built from other item weights than the model's."""


@dataclass(frozen=True)
class FaissConfig:
    """How the index is built and searched.

    kind: ``"hnsw"`` or ``"ivf"``. hnsw_m: graph degree; ef_construction /
    ef_search: HNSW's candidate lists when building / searching. nlist: IVF
    cells (0: ``sqrt(N)``, k-means on 40 items a cell); nprobe: cells scanned per
    query. extra: candidates fetched beyond ``k`` + the user's excluded items, rescored exactly.
    lse_sample: items of the fixed sample that estimates the log-sum-exp.
    seed: of the IVF training sample and the log-sum-exp sample.
    """

    kind: str = "ivf"
    hnsw_m: int = 32
    ef_construction: int = 64
    ef_search: int = 128
    nlist: int = 0
    nprobe: int = 64
    extra: int = 32
    lse_sample: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("hnsw_m", "ef_construction", "ef_search", "nprobe", "lse_sample"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("nlist", "extra", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _factors(model: SequentialRecommender) -> tuple[Tensor, Tensor | None]:
    """The real items' output embeddings (N, d) and bias (N,) or None, float32, as
    :class:`Scorer` takes them."""
    with torch.no_grad():
        weights = model.item_weights()
        bias = model.item_bias()
        items = weights[1:].detach().float().cpu()
        b = None if bias is None else bias[1 : weights.shape[0]].detach().float().cpu()
    return items, b


def item_digest(model: SequentialRecommender) -> str:
    """sha256 of the item table and bias the index is built from (and of nothing else:
    a model whose encoder changed but whose items did not keeps its index)."""
    items, bias = _factors(model)
    h = hashlib.sha256()
    h.update(str(tuple(items.shape)).encode())
    h.update(items.contiguous().numpy().tobytes())
    if bias is not None:
        h.update(b"bias")
        h.update(bias.contiguous().numpy().tobytes())
    return h.hexdigest()


def _augmented(items: Tensor, bias: Tensor | None) -> np.ndarray:
    """Index vectors (N, d + 2) float32: ``[v_j, b_j, sqrt(R^2 - |v_j|^2 - b_j^2)]``; the
    last column is the L2 reduction's (an inner-product search ignores it: the query's
    last entry is 0)."""
    b = torch.zeros(items.shape[0]) if bias is None else bias
    x = torch.cat([items.double(), b.double().unsqueeze(1)], 1)
    norms = x.square().sum(1)
    radius2 = float(norms.max()) if len(norms) else 0.0
    pad = (radius2 - norms).clamp_min(0.0).sqrt().unsqueeze(1)
    return torch.cat([x, pad], 1).float().numpy()


class ItemIndex:
    """A faiss index over a model's items; :meth:`topk` is the tiled top-k's contract."""

    def __init__(self, index: Any, config: FaissConfig, digest: str, sample: np.ndarray) -> None:
        self.index, self.config, self.digest = index, config, digest
        self.sample = torch.as_tensor(sample, dtype=torch.long)  # 0-based item columns
        self._heads: Tensor | None = None  # the items of largest norm, always candidates
        self._where: Tensor | None = None  # (N,) each item's place in the sample, -1 if none
        self._tune()

    def _tune(self) -> None:
        import faiss

        if self.config.kind == "hnsw":
            graph: Any = faiss.downcast_index(self.index)
            graph.hnsw.efSearch = self.config.ef_search
        else:
            faiss.extract_index_ivf(self.index).nprobe = self.config.nprobe

    @property
    def num_items(self) -> int:
        return int(self.index.ntotal)

    @classmethod
    def build(cls, model: SequentialRecommender, config: FaissConfig | None = None) -> ItemIndex:
        """Index the model's item table (minutes at 1M items for ``hnsw``)."""
        import faiss

        config = config or FaissConfig()
        items, bias = _factors(model)
        x = _augmented(items, bias)
        n, dim = x.shape
        index: Any
        if config.kind == "hnsw":  # inner product: an item far out (a large bias) stays found
            index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = config.ef_construction
            index.add(x)
        else:
            nlist = config.nlist or max(1, min(int(math.sqrt(n)), n // 40 or 1))
            quantizer = faiss.IndexFlatL2(dim)
            index = faiss.IndexIVFFlat(quantizer, dim, nlist)
            rng = np.random.default_rng(config.seed)
            train = x if n <= 40 * nlist else x[rng.choice(n, 40 * nlist, replace=False)]
            index.train(train)
            index.add(x)
        rng = np.random.default_rng(config.seed + 1)
        m = min(config.lse_sample, n)
        sample = np.arange(n) if m == n else np.sort(rng.choice(n, m, replace=False))
        return cls(index, config, item_digest(model), sample)

    # ------------------------------------------------------------ files

    def save(self, path: str | Path) -> Path:
        """Write the index to ``path`` and its description (digest, settings, sample) to
        ``path`` + ``.json``; each file is written to a temporary name and renamed."""
        import faiss

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        faiss.write_index(self.index, str(tmp))
        tmp.replace(path)
        meta = {"digest": self.digest, "config": asdict(self.config),
                "sample": self.sample.tolist(), "num_items": self.num_items}  # fmt: skip
        side = path.with_name(path.name + ".json")
        tmp_side = side.with_name(side.name + ".tmp")
        tmp_side.write_text(json.dumps(meta))
        tmp_side.replace(side)
        return path

    @classmethod
    def load(cls, path: str | Path, model: SequentialRecommender) -> ItemIndex:
        """Read an index saved by :meth:`save`, checked against ``model``'s items by
        digest: ``StaleIndexError`` naming the file when they differ."""
        import faiss

        path = Path(path)
        side = path.with_name(path.name + ".json")
        try:
            meta = json.loads(side.read_text())
            config = FaissConfig(**meta["config"])
            digest, sample = str(meta["digest"]), np.asarray(meta["sample"], dtype=np.int64)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{side}: not the description of a saved item index ({err})") from None
        current = item_digest(model)
        if digest != current:
            raise StaleIndexError(
                f"{path}: the index was built from other item weights (digest {digest[:12]}, "
                f"the checkpoint's {current[:12]}): delete it to rebuild"
            )
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as err:
            raise ValueError(f"{path}: not a faiss index ({str(err).splitlines()[0]})") from None
        if index.ntotal != model.num_items:
            raise StaleIndexError(f"{path}: {index.ntotal} items, the model has {model.num_items}")
        return cls(index, config, digest, sample)

    # ------------------------------------------------------------ search

    @torch.no_grad()
    def topk(
        self, scorer: Scorer, k: int, exclude: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Top-k (U, min(k, N)) scores and 0-based columns, best first, and the
        log-sum-exp (U,) (candidates exact, the rest estimated): ``tiled_topk``'s
        contract, with the approximation in which items are found."""
        n = scorer.num_items
        if n != self.num_items:
            raise ValueError(f"the index holds {self.num_items} items, the scorer {n}")
        users = scorer.users.float().cpu()
        u = users.shape[0]
        kk = min(k, n)
        scale = torch.ones(u, 1) if scorer.scale is None else scorer.scale.float().cpu()
        query = torch.cat([users, torch.ones(u, 1), torch.zeros(u, 1)], 1) * scale
        excluded = 0 if exclude is None or not exclude.numel() else int((exclude > 0).sum(1).max())
        fetch = min(n, kk + excluded + self.config.extra)
        _, found = self.index.search(query.numpy(), fetch)
        heads = self._largest(scorer).expand(u, -1)
        cand = torch.cat([torch.from_numpy(found).long(), heads], 1)  # 0-based, -1: none found
        valid = cand >= 0
        cand = cand.clamp_min(0)
        scores = self._scores(scorer, cand)
        scores = scores.masked_fill(~valid, float("-inf"))
        # a column found twice (never by faiss, but cheap to rule out) counts once
        dup = torch.zeros_like(valid)
        ordered, pos = cand.sort(1)
        dup.scatter_(1, pos[:, 1:], ordered[:, 1:] == ordered[:, :-1])
        scores = scores.masked_fill(dup, float("-inf"))
        if exclude is not None:
            ex = exclude.cpu().long() - 1  # -1: padding
            hit = (cand.unsqueeze(2) == ex.unsqueeze(1)).any(2)
            scores = scores.masked_fill(hit, float("-inf"))
        v, pos = scores.topk(kk, dim=1)
        cols = cand.gather(1, pos)
        lse = self._logsumexp(scorer, scores, cand.masked_fill(~valid, -1), exclude)
        dev = scorer.users.device
        return v.to(scorer.users.dtype).to(dev), cols.to(dev), lse.to(dev)

    def _largest(self, scorer: Scorer) -> Tensor:
        """(1, extra) the items whose ``|[v_j, b_j]|`` is largest: the best scored for many
        users, and far from the rest, where a graph's or a cell's search can miss them
        (an item with a large bias); rescored with the found ones at no cost worth naming."""
        if self._heads is None:
            norms = scorer.items.float().square().sum(1)
            if scorer.bias is not None:
                norms = norms + scorer.bias.float().square()
            count = min(self.config.extra, norms.numel())
            self._heads = norms.topk(count).indices.cpu().unsqueeze(0)
        return self._heads

    @staticmethod
    def _scores(scorer: Scorer, cand: Tensor) -> Tensor:
        """Exact scores (U, m) of each user's candidate columns, in the tiled order
        ``(u V^T + b) * s`` after one product per user."""
        users, items = scorer.users, scorer.items
        dev = users.device
        cand = cand.to(dev)
        out = torch.bmm(items[cand], users.unsqueeze(2)).squeeze(2)  # (U, m)
        if scorer.bias is not None:
            out = out + scorer.bias[cand]
        if scorer.scale is not None:
            out = out * scorer.scale
        return out.float().cpu()

    def _logsumexp(
        self, scorer: Scorer, cand_scores: Tensor, cand: Tensor, exclude: Tensor | None
    ) -> Tensor:
        """Exact log-sum-exp over the candidates plus ``N / m`` times the sampled items'
        sum, candidates (``cand``, -1 = none) and excluded items counted as zero there;
        exact when the sample is every item."""
        head = torch.logsumexp(cand_scores, dim=1)  # excluded candidates already -inf
        n, m = scorer.num_items, self.sample.numel()
        tail = scorer.columns(self.sample.to(scorer.users.device)).float().cpu()  # (U, m)
        if self._where is None:
            self._where = torch.full((n,), -1, dtype=torch.long)
            self._where[self.sample] = torch.arange(m)
        tail = _mask_members(tail, self._where, cand)
        if exclude is not None:
            tail = _mask_members(tail, self._where, exclude.cpu().long() - 1)
        return torch.logaddexp(head, torch.logsumexp(tail, dim=1) + math.log(n / m))


def _mask_members(tail: Tensor, where: Tensor, cols: Tensor) -> Tensor:
    """``tail`` (U, m) at -inf where the sampled item is among the user's ``cols`` (U, c),
    0-based columns, -1 for none; ``where`` (N,) maps an item to its sample place or -1."""
    if cols.shape[1] == 0:
        return tail
    place = where[cols.clamp_min(0)].masked_fill(cols < 0, -1)  # (U, c)
    rows, at = (place >= 0).nonzero(as_tuple=True)
    tail[rows, place[rows, at]] = float("-inf")
    return tail
