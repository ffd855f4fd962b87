"""``Recommender``: a checkpoint and its vocabulary -> raw item ids, scores, confidence.

    from bft_lightning import Recommender
    rec = Recommender.from_checkpoint("best.ckpt", device="cpu")
    out = rec.recommend([["B00X1", "B00Q7"], ["B01Z4"]], k=10, exclude_seen=True)
    out[0].items, out[0].scores, out[0].confidence

No data file is read: the checkpoint holds the raw item ids in index order,
the training item counts and how to rebuild its backbone. The rules for
unknown ids, empty histories, long histories and ``k`` are in
``docs/recommend.md`` and on :meth:`Recommender.recommend`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bft_lightning.models.base import SequentialRecommender
from bft_lightning.retrieval.seen_default import default_exclude_seen
from bft_lightning.utils.checkpoint_format import load_record, read_record, save_checkpoint
from bft_lightning.utils.checkpoint_io import CheckpointLoadError, safe_load_checkpoint
from bft_lightning.utils.checks import check_bool, check_int
from bft_lightning.utils.devices import check_device

from .histories import EncodedHistory, check_times, left_pad, pad_times
from .hit_calibration import ConfidenceCalibration, feature_names, fit_calibration
from .inference import list_features, rank_next
from .item_index import check_retrieval, open_index
from .lists import Recommendation, UnknownItemsError

__all__ = ["EncodedHistory", "Recommendation", "Recommender", "UnknownItemsError"]


def _import(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    if not isinstance(cls, type) or not issubclass(cls, SequentialRecommender):
        raise ValueError(f"{class_path} is not a SequentialRecommender class")
    return cls


class Recommender:
    """A trained sequential recommender in eval mode that maps raw ids both ways.

    Args:
        model: the backbone (``SASRec``, ``BERT4Rec``, ``HSTU``).
        item_ids: raw item ids in index order, ``item_ids[0] == ""`` (padding).
        item_frequency: ``(num_items + 1,)`` training counts (cold users' ranking).
        device: where the model runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        calibration: maps each list to ``P(hit@k)`` (``calibrate``); None: raw signal.
        trained_with_times: whether the training data had timestamps (the
            checkpoint records it); None: not known (a checkpoint saved before
            it was recorded). See :attr:`needs_times`.
        retrieval: ``"exact"`` or ``"faiss"`` (``serving.item_index``: ``item_index``, or built).
    """

    def __init__(
        self,
        model: SequentialRecommender,
        item_ids: Sequence[str],
        item_frequency: Tensor | Sequence[int],
        device: str | torch.device = "cpu",
        calibration: ConfidenceCalibration | None = None,
        trained_with_times: bool | None = None,
        retrieval: str = "exact",
        item_index: Any = None,
    ) -> None:
        if len(item_ids) != model.num_items + 1 or (len(item_ids) and str(item_ids[0]) != ""):
            raise ValueError(
                f"item_ids must hold num_items + 1 = {model.num_items + 1} ids with item_ids[0] "
                f"== '' (padding), got {len(item_ids)}"
            )
        self.device = check_device(device, "device")
        self.model = model.to(self.device).eval()
        self.item_ids = np.array([str(i) for i in item_ids], dtype=object)
        self.index = {raw: i for i, raw in enumerate(self.item_ids) if i > 0}
        freq = torch.as_tensor(item_frequency, dtype=torch.float64)[: self.num_items + 1]
        # cold users: add-one smoothed training popularity, a log-probability over the items
        prior = torch.log((freq[1:] + 1.0) / (freq[1:].sum() + self.num_items))
        self._prior = torch.cat([prior.new_full((1,), -math.inf), prior]).float()
        self._log_count = torch.log1p(freq).float()  # (num_items + 1,) for the confidence
        self.calibration = calibration
        self.trained_with_times = trained_with_times
        if calibration is not None:
            self._check_calibration(calibration, "calibration")
        self.retrieval, self.fingerprint = check_retrieval(retrieval), None  # data's
        self.repeat_rate: float | None = None  # the training data's (from_checkpoint)
        self.item_index = (item_index or open_index(model)) if retrieval == "faiss" else None

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu",
                        retrieval: str = "exact") -> Recommender:  # fmt: skip
        """Rebuild the backbone a recommendation checkpoint was saved from, with its weights.

        Loaded with ``weights_only=True`` (no code runs). Raises ``ValueError``
        naming the file when it is not such a checkpoint, holds no item
        vocabulary (saved before checkpoints stored one: raw ids cannot be
        mapped) or does not record how to build its backbone. ``retrieval="faiss"``:
        the item index saved beside the file, else one built and saved there.
        """
        device = check_device(device, "device")
        checkpoint, info = load_record(path)
        if info is None or not isinstance(checkpoint.get("state_dict"), dict):
            raise CheckpointLoadError(f"{path}: not a checkpoint of SequentialRecommendation")
        vocabulary = info.vocabulary
        if not isinstance(vocabulary, dict) or "item_ids" not in vocabulary:
            raise CheckpointLoadError(
                f"{path}: the checkpoint holds no item vocabulary (saved before checkpoints "
                "stored one): raw item ids cannot be mapped to the model's indices; train it "
                "again (or fit one more epoch from it) to write a checkpoint that has one"
            )
        spec = info.backbone_init
        if not isinstance(spec, dict):
            raise CheckpointLoadError(
                f"{path}: the checkpoint does not record how to build its backbone "
                f"({info.backbone}): it was built by a factory that is neither a class "
                "nor a functools.partial of one"
            )
        hparams = checkpoint.get("hyper_parameters") or {}
        max_len = int(info.max_len or hparams.get("max_len") or vocabulary["max_len"])
        model = _import(spec["class_path"])(
            int(info.num_items or 0), max_len, **dict(spec.get("init_args") or {})
        )
        state = {
            name[len("model.") :]: tensor
            for name, tensor in checkpoint["state_dict"].items()
            if name.startswith("model.")
        }
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[0]
            raise CheckpointLoadError(f"{path}: weights do not fit the backbone: {first}") from None
        calibration = None
        if info.calibration is not None:
            calibration = ConfidenceCalibration.from_dict(info.calibration, str(path))
        timed = info.timestamps
        index = open_index(model, path) if check_retrieval(retrieval) == "faiss" else None
        rec = cls(model, vocabulary["item_ids"], vocabulary["item_frequency"], device, calibration,
                  None if timed is None else bool(timed), retrieval, index)  # fmt: skip
        rec.fingerprint = vocabulary.get("fingerprint")
        rec.repeat_rate = info.repeat_rate
        return rec

    @property
    def exclude_seen_default(self) -> tuple[bool, str]:
        """``(exclude_seen, why)`` when a caller does not say (``retrieval.seen_default``)."""
        return default_exclude_seen(self.repeat_rate)

    def _check_calibration(self, calibration: ConfidenceCalibration, source: str) -> None:
        expected = feature_names(self.model.precision)
        if calibration.features != expected:
            raise ValueError(
                f"{source}: the confidence calibration is for features {calibration.features}, "
                f"this precision={self.model.precision!r} model gives {expected}"
            )

    # ------------------------------------------------------------ properties

    @property
    def num_items(self) -> int:
        """Number of items the model ranks (``k`` can be at most this)."""
        return self.model.num_items

    @property
    def max_len(self) -> int:
        """The longest history the model reads; longer ones use their last ``max_len`` items."""
        return self.model.max_len

    @property
    def uses_times(self) -> bool:
        """Whether timestamps given to :meth:`recommend` reach the model: its backbone
        reads them (HSTU's time bias) and it was not trained without them."""
        return bool(getattr(self.model, "uses_timestamps", False)) and (
            self.trained_with_times is not False
        )

    @property
    def needs_times(self) -> bool:
        """Whether :meth:`recommend` requires timestamps for every non-empty history:
        the backbone reads them and the checkpoint says it was trained with them
        (without them it would compute another function than the one trained)."""
        return self.uses_times and self.trained_with_times is True

    # ------------------------------------------------------------ recommending

    def check_k(self, k: object) -> int:
        """``k`` if it is an integer in ``1..num_items``; else ``ValueError`` naming it."""
        if (
            isinstance(k, bool)
            or not isinstance(k, int | np.integer)
            or not 1 <= k <= self.num_items
        ):
            raise ValueError(
                f"k must be an integer in 1..{self.num_items} (the checkpoint's item count), "
                f"got {k!r}"
            )
        return int(k)

    def encode(
        self,
        history: Sequence[str | int],
        position: int = 0,
        times: Sequence[int | float] | None = None,
    ) -> EncodedHistory:
        """The history in the checkpoint's indices: known items (oldest first), the raw
        ids it does not know, and the known items' timestamps.

        Ids are compared as strings (``1234`` and ``"1234"`` are the same item).
        ``times`` (one number per item, unix seconds) must have the history's
        length; an unknown item's time is dropped with it. Raises
        ``UnknownItemsError`` when the history is not empty but none is known,
        ``ValueError`` naming ``position`` for a bad history or bad times, and
        when :attr:`needs_times` and a non-empty history has none.
        """
        if isinstance(history, str | bytes) or not isinstance(history, Sequence):
            raise ValueError(
                f"history {position}: expected a list of item ids, got {type(history).__name__}"
            )
        stamps = None if times is None else check_times(times, len(history), position)
        if stamps is None and self.needs_times and len(history):
            raise ValueError(
                f"history {position}: no timestamps, but the checkpoint's "
                f"{type(self.model).__name__} was trained with them (its attention has a "
                "learned time bias): give each history its times (recommend(..., times=...), "
                'a "times" field or a timestamp column)'
            )
        known, unknown, known_times = [], [], []
        for j, raw in enumerate(history):
            if isinstance(raw, bool) or not isinstance(raw, str | int | np.integer):
                raise ValueError(
                    f"history {position}, item {j}: expected a string or integer item id, "
                    f"got {raw!r}"
                )
            key = str(raw).strip()
            code = self.index.get(key)
            if code is None:
                unknown.append(key)
            else:
                known.append(code)
                if stamps is not None:
                    known_times.append(stamps[j])
        if unknown and not known:
            raise UnknownItemsError(position, unknown)
        use = stamps is not None and self.uses_times
        return EncodedHistory(known, tuple(unknown), known_times if use else None)

    def recommend(
        self,
        histories: Sequence[Sequence[str | int]],
        k: int = 10,
        exclude_seen: bool | None = None,
        batch_size: int = 256,
        times: Sequence[Sequence[int | float] | None] | None = None,
    ) -> list[Recommendation]:
        """The top ``k`` next items for each history (raw item ids, oldest first).

        ``times``: one list of timestamps (unix seconds, as in the training
        data) per history, parallel to its items, or None. They reach the model
        only where it reads them (:attr:`uses_times`: HSTU's time bias, when
        trained with timestamps); SASRec and BERT4Rec check and ignore them. A
        history whose times have another length is a ``ValueError`` naming its
        index; so is a missing one when :attr:`needs_times` (an HSTU trained
        with timestamps would otherwise run without its time bias).

        - Unknown ids (not in the checkpoint's vocabulary) are skipped and
          listed in ``Recommendation.unknown``; a non-empty history with no
          known id raises ``UnknownItemsError`` naming them.
        - An empty history (a cold user) gets the ``k`` most frequent training
          items, scored by their smoothed log-probability ``log((n_i + 1) /
          (N + num_items))``; its confidence is their total probability.
        - A history longer than ``max_len`` is read through its last
          ``max_len`` known items (BERT4Rec: ``max_len - 1`` and its mask token,
          as in training and evaluation);
          ``exclude_seen`` still excludes every item of the whole history.
        - ``exclude_seen`` None: the checkpoint's default (:attr:`exclude_seen_default`,
          from its training data's repeat rate). With it, fewer than ``k`` items
          are returned only when fewer remain.
        - ``k`` must be in ``1..num_items``, else ``ValueError`` naming it.

        Runs in batches of ``batch_size`` histories, in eval mode, without
        gradients, on the recommender's device.
        """
        k = self.check_k(k)
        if exclude_seen is None:
            exclude_seen = self.exclude_seen_default[0]
        exclude_seen = check_bool(exclude_seen, "exclude_seen")
        if isinstance(histories, str | bytes) or not isinstance(histories, Sequence):
            raise ValueError("histories must be a list of histories (lists of item ids)")
        batch_size = check_int(batch_size, "batch_size", 1)
        if times is not None and len(times) != len(histories):
            raise ValueError(f"{len(times)} lists of times for {len(histories)} histories")
        out: list[Recommendation] = []
        for start in range(0, len(histories), batch_size):
            encoded = [
                self.encode(h, start + i, None if times is None else times[start + i])
                for i, h in enumerate(histories[start : start + batch_size])
            ]
            out += self.recommend_encoded(encoded, k, exclude_seen)
        return out

    def recommend_encoded(
        self, encoded: Sequence[EncodedHistory], k: int, exclude_seen: bool
    ) -> list[Recommendation]:
        """:meth:`recommend` for histories already mapped by :meth:`encode` (one batch)."""
        warm = [i for i, e in enumerate(encoded) if e.items]
        results: dict[int, Recommendation] = {}
        if warm:
            rows = [encoded[i].items for i in warm]
            width = min(max(len(r) for r in rows), self.max_len)
            ids = left_pad(rows, width)
            stamps = pad_times([encoded[i] for i in warm], width)
            exclude = None
            if exclude_seen:
                exclude = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
                for r, row in enumerate(rows):
                    exclude[r, : len(row)] = torch.tensor(row)
                exclude = exclude.to(self.device)
            stamps = None if stamps is None else stamps.to(self.device)
            rest = (stamps, exclude, self.calibration, self._log_count, self.item_index)
            top, confidence = rank_next(self.model, ids.to(self.device), k, *rest)
            scores, items = top.scores.cpu(), top.ids.cpu()
            confidence = confidence.cpu()
            for r, i in enumerate(warm):
                valid = items[r] > 0
                results[i] = Recommendation(
                    items=list(self.item_ids[items[r][valid].numpy()]),
                    scores=scores[r][valid].tolist(),
                    confidence=float(confidence[r]),
                    unknown=encoded[i].unknown,
                )
        if len(warm) < len(encoded):
            cold = self._cold(k)
            for i in range(len(encoded)):
                results.setdefault(i, cold)
        return [results[i] for i in range(len(encoded))]

    # ------------------------------------------------------------ calibration

    def calibrate(
        self,
        histories: Sequence[Sequence[str | int]],
        targets: Sequence[str | int],
        k: int = 10,
        batch_size: int = 512,
        times: Sequence[Sequence[int | float] | None] | None = None,
    ) -> dict[str, Any]:
        """Fit the confidence on held-out users: ``P(target among the first k)``.

        histories: raw item ids, oldest first, one list per user; targets: each
        user's actual next item (raw id); times: per history, as in
        :meth:`recommend`. Users with an empty history or whose
        target or whole history the checkpoint does not know are left out and
        counted. Sets :attr:`calibration` (``save_calibration`` writes it into a
        checkpoint) and returns ``{"users", "left_out", "hit_rate", "auroc"}``.
        Use users the model was not trained on (the validation split).
        """
        k = self.check_k(k)
        if k >= self.num_items:
            raise ValueError(f"k must be below the item count ({self.num_items}) to calibrate")
        if len(histories) != len(targets):
            raise ValueError(f"{len(histories)} histories but {len(targets)} targets")
        if times is not None and len(times) != len(histories):
            raise ValueError(f"{len(times)} lists of times for {len(histories)} histories")
        rows: list[list[int]] = []
        codes: list[int] = []
        stamps: list[list[int] | None] = []
        left_out = 0
        for i, (history, target) in enumerate(zip(histories, targets, strict=True)):
            code = self.index.get(str(target).strip())
            try:
                encoded = self.encode(history, i, None if times is None else times[i])
            except UnknownItemsError:
                encoded = None
            if code is None or encoded is None or not encoded.items:
                left_out += 1
                continue
            rows.append(encoded.items)
            codes.append(code)
            stamps.append(encoded.times)
        return self.calibrate_encoded(
            rows,
            codes,
            k,
            batch_size,
            left_out,
            stamps if any(t is not None for t in stamps) else None,
        )

    def calibrate_encoded(
        self,
        rows: Sequence[Sequence[int]],
        targets: Sequence[int],
        k: int = 10,
        batch_size: int = 512,
        left_out: int = 0,
        times: Sequence[Sequence[int] | None] | None = None,
    ) -> dict[str, Any]:
        """:meth:`calibrate` for histories and targets already in the checkpoint's indices
        (``times``: whole-second timestamps parallel to ``rows``, or None)."""
        if times is None and self.needs_times:
            raise ValueError(
                f"the checkpoint's {type(self.model).__name__} was trained with timestamps: "
                "calibrate it on histories with their times"
            )
        xs, hits = [], []
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            width = min(max(len(r) for r in batch), self.max_len)
            ids = left_pad(batch, width)
            stamps = None
            if times is not None and self.uses_times:
                part = times[start : start + batch_size]
                stamps = pad_times([EncodedHistory(list(r), (), None if t is None else list(t))
                                    for r, t in zip(batch, part, strict=True)], width)  # fmt: skip
                stamps = None if stamps is None else stamps.to(self.device)
            top, x = list_features(self.model, ids.to(self.device), k, self._log_count, stamps)
            target = torch.tensor(list(targets[start : start + batch_size]))
            hits.append((top.ids[:, :k].cpu() == target.unsqueeze(1)).any(1))
            xs.append(x)
        if not xs:
            raise ValueError("no held-out user to calibrate on (all left out)")
        self.calibration = fit_calibration(
            torch.cat(xs), torch.cat(hits), feature_names(self.model.precision), k
        )
        return {"users": self.calibration.n_users, "left_out": left_out,
                "hit_rate": self.calibration.hit_rate, "auroc": self.calibration.auroc}  # fmt: skip

    def save_calibration(self, checkpoint: str | Path, output: str | Path | None = None) -> Path:
        """Write :attr:`calibration` into a copy of ``checkpoint`` (``output``, default in place).

        The file is replaced atomically, with a new content digest; everything
        else in it is kept.
        """
        if self.calibration is None:
            raise ValueError("no calibration to save: call calibrate() first")
        from bft_lightning.utils.checkpoint_format import write_record

        state = safe_load_checkpoint(checkpoint)
        info = read_record(state)
        if info is None:
            raise CheckpointLoadError(f"{checkpoint}: not a checkpoint of SequentialRecommendation")
        write_record(state, info.with_calibration(self.calibration.to_dict()))
        return save_checkpoint(state, Path(output) if output is not None else Path(checkpoint))

    def _cold(self, k: int) -> Recommendation:
        scores, ids = torch.topk(self._prior, k)
        return Recommendation(
            items=list(self.item_ids[ids.numpy()]),
            scores=scores.tolist(),
            confidence=float(torch.exp(torch.logsumexp(scores.double(), 0)).clamp(max=1.0)),
            cold=True,
        )

    def describe(self) -> dict[str, Any]:
        """Item count, ``max_len``, backbone class and device, for logs."""
        cal = self.calibration
        return {"items": self.num_items, "max_len": self.max_len,
                "backbone": type(self.model).__name__, "device": str(self.device),
                "timestamps": "required" if self.needs_times else
                ("used when given" if self.uses_times else "not read"),
                "confidence": f"P(hit@{cal.k}), calibrated on {cal.n_users} users"
                if cal is not None else "raw signal (not calibrated)"}  # fmt: skip
