"""What every sequential recommender shares: item embeddings, the layer-0
precision prior, a BFT encoder and the dot-product head.

A backbone says how a training batch becomes inputs and labels
(``train_view``), how an evaluation history becomes inputs (``eval_view``),
and builds its own encoder (``build_encoder``). Batches follow the
``SequenceDataModule`` contract: train ``{"seq": (B, L + 1)}``, eval
``{"input_ids": (B, L)}``, item ids left-padded with 0.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Collection
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bft_lightning.nn import BFTEncoder, BFTEncoderLayer, MLPPrecisionPrior, PrecisionPrior
from bft_lightning.nn.checks import check_dropout, check_number, check_sizes
from bft_lightning.nn.filter import FILTER_FIELDS, FilterConfig
from bft_lightning.nn.prior import PRIOR_INITS

PRIOR_KINDS = ("table", "mlp")
# the filter options a recommender runs with when neither form names them
MODEL_FILTER_DEFAULTS = FilterConfig(precision="off")
HEADS = ("dot", "precision")


class Encoded(NamedTuple):
    """What the encoder gives its callers.

    hidden: the normalised states the head scores, (B, L, d) or, at the
        predicting position, (B, d).
    log_precision: the final ``log lambda`` in the encoder's units, (B, L, G)
        or (B, G); None in off mode.
    norm_scale: (B,) the final norm's divisor ``sigma(h)`` at the last position:
        a variance ``1 / lambda`` of ``h`` is ``1 / (lambda sigma^2)`` in the
        state that is scored (``serving.confidence`` reads it as an argument).
    """

    hidden: Tensor
    log_precision: Tensor | None
    norm_scale: Tensor


class SequentialRecommender(nn.Module):
    """Base class of SASRec, BERT4Rec and HSTU.

    Args:
        num_items: number of items (ids 1..num_items; 0 is padding).
        max_len: the longest history the model reads.
        d_model: width ``d``.
        nhead: attention heads.
        num_layers: encoder layers.
        dim_feedforward: FFN width.
        dropout: dropout rate (embeddings, attention, FFN).
        precision: ``"on"`` (BFT) or ``"off"`` (the plain backbone).
        groups: precision groups ``G`` (divisor of ``d``); None means ``nhead``.
        prior: layer-0 precision prior, ``"table"`` (per item) or ``"mlp"``.
        prior_init: ``"constant"``, ``"frequency"``, or the controls
            ``"frequency_shuffled"`` and ``"frequency_inverse"`` (table prior only).
        prior_scale: ``c``; None matches the input scale, ``1 / mean Var(h0)``.
        prior_width: 1 (one tau per item) or ``G``.
        q_init: initial process noise ``Q0``.
        nu0: prior degrees of freedom of the REML sill (weight of the running sill
            against a token's own spread in the observation variance).
        attention_gate: None or ``"sigmoid"`` (gated-attention baseline).
        head: ``"dot"`` (item dot product) or ``"precision"`` (the final
            precision sets a per-user temperature of the scores, so the last
            layer's ``Q`` is trained too).
        attention_impl: a kernel of ``nn.kernels.KERNELS``: ``"chunked"`` (query
            blocks with a hand-written backward, no (T x T) weights kept; the off
            twin runs PyTorch's fused attention), ``"blockwise"`` (one pass over key
            blocks, a ``torch.library`` custom op that ``torch.compile`` keeps in one
            graph) or ``"reference"`` (materialised weights, ``docs/spec.md``'s
            reference); or ``"auto"`` (the default, also for None): ``"chunked"``
            in eager mode and ``"blockwise"`` while ``torch.compile`` traces
            (resolved by ``nn.kernels.resolve``). Same values and gradients. HSTU
            has its own attention.
        attention_chunk: query block size of the chunked path.
        gain: ``"group"`` (``docs/spec.md``: a Kalman gain per residual group after
            ``W_O``) or ``"head"`` (a gain per head before ``W_O``; see
            ``BFTEncoderLayer``). HSTU supports ``"group"`` only.
        key_precision: False attends without the keys' precision bias and
            keeps the gain and the dynamics (an ablation; see
            ``BFTEncoderLayer``). SASRec and BERT4Rec only.
        positions: ``"from_end"`` (default: position = distance from the row's last
            slot, as in SASRec's left-padded window) or ``"from_start"`` (index from
            the row's first item, as RecBole's per-prefix rows: a prefix's last state
            is the same inside a longer row and alone). On Amazon Beauty the two
            peaked at about the same validation NDCG@10 (``results/perf/notes.md``).
        filter: the filter options as one typed ``FilterConfig`` (YAML:
            ``filter: {precision: "on", groups: null, ...}``; the shipped configs'
            form). The flat ``precision``, ``groups``, ``q_init``, ``nu0``,
            ``attention_gate``, ``attention_impl``, ``attention_chunk``, ``gain``
            and ``key_precision`` above are the same options spelled flat, for
            configs and checkpoints written before ``filter`` existed and for short
            command lines; they become a ``FilterConfig`` in one place,
            ``FilterConfig.from_flat``. Give one form or the other (a ``filter``
            left at its default counts as not given). Its ``predict_noise`` is
            set per layer by the model.
    """

    causal: ClassVar[bool] = True
    extra_tokens: ClassVar[int] = 0  # ids after num_items (e.g. BERT4Rec's mask)
    uses_timestamps: ClassVar[bool] = False  # whether encode reads times (HSTU)

    def __init__(
        self,
        num_items: int,
        max_len: int = 50,
        d_model: int = 64,
        nhead: int = 2,
        num_layers: int = 2,
        dim_feedforward: int = 256,
        dropout: float = 0.2,
        precision: str = "off",
        groups: int | None = None,
        prior: str = "table",
        prior_init: str = "constant",
        prior_scale: float | None = None,
        prior_width: int = 1,
        q_init: float = 0.01,
        nu0: float = 1.0,
        attention_gate: str | None = None,
        head: str = "dot",
        attention_impl: str | None = None,
        attention_chunk: int = 256,
        gain: str = "group",
        key_precision: bool = True,
        positions: str = "from_end",
        filter: FilterConfig = MODEL_FILTER_DEFAULTS,
    ) -> None:
        super().__init__()
        flat = dict(
            precision=precision, groups=groups, q_init=q_init, nu0=nu0,
            attention_gate=attention_gate, attention_impl=attention_impl,
            attention_chunk=attention_chunk, gain=gain, key_precision=key_precision,
        )  # fmt: skip
        config = FilterConfig.from_flat(flat, filter, defaults=MODEL_FILTER_DEFAULTS)
        precision, groups = config.precision, config.groups
        _check_options(num_items, max_len, prior, prior_init, head)
        check_sizes(num_items=num_items, max_len=max_len, d_model=d_model, nhead=nhead,
                    num_layers=num_layers, prior_width=prior_width)  # fmt: skip
        check_dropout("dropout", dropout)
        check_number("prior_scale", prior_scale, 0.0, low_open=True, optional=True)
        if head == "precision" and precision != "on":  # its temperature would get no gradient
            raise ValueError("head='precision' reads the final precision: it needs precision='on'")
        if positions not in ("from_end", "from_start"):
            raise ValueError(f"positions must be 'from_end' or 'from_start', got {positions!r}")
        self.positions = positions
        self.num_items, self.max_len, self.d_model = num_items, max_len, d_model
        self.precision, self.head, self.prior_init = precision, head, prior_init
        self.groups = nhead if groups is None else groups
        self.item_emb = nn.Embedding(num_items + 1 + self.extra_tokens, d_model, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.item_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()
        self.emb_dropout = nn.Dropout(dropout)
        self.nhead, self.dim_feedforward, self.dropout = nhead, dim_feedforward, dropout
        self.filter = config
        self.encoder = self.build_encoder(config, num_layers)
        self.final_norm = nn.LayerNorm(d_model)
        self.prior: PrecisionPrior | MLPPrecisionPrior | None = None
        if precision == "on":
            scale = prior_scale if prior_scale is not None else self.input_scale()
            width = self.groups if prior_width != 1 else 1
            if prior == "table":
                self.prior = PrecisionPrior(self.item_emb.num_embeddings, width, "constant", scale)
            else:
                self.prior = MLPPrecisionPrior(d_model, width, scale=scale)
            if head == "dot":  # the last layer's precision feeds nothing: no Q there
                self._last_layer().predict_noise = False
        if head == "precision":
            self.temperature = nn.Linear(self.groups, 1)
            nn.init.zeros_(self.temperature.weight)
            nn.init.zeros_(self.temperature.bias)

    # -- construction -----------------------------------------------------------------
    def build_encoder(self, config: FilterConfig, num_layers: int) -> nn.Module:
        """The encoder stack of ``num_layers`` layers run with ``config``; HSTU overrides this.

        The shape comes from the model (``d_model``, ``nhead``, ``dim_feedforward``,
        ``dropout``)."""
        layer = BFTEncoderLayer(
            self.d_model, self.nhead, self.dim_feedforward, self.dropout, activation="gelu",
            config=config,
        )  # fmt: skip
        return BFTEncoder(layer, num_layers)

    def _last_layer(self) -> Any:
        return list(self.encoder.layers)[-1]  # type: ignore[union-attr, arg-type]

    def embedding_scale(self) -> float:
        """Multiplier of the item embedding (SASRec: sqrt(d))."""
        return 1.0

    @torch.no_grad()
    def input_scale(self) -> float:
        """``c = 1 / mean Var(h0)`` at initialisation: precision matched to the input scale."""
        items = self.item_emb.weight[1 : self.num_items + 1] * self.embedding_scale()
        var = items.var(dim=-1, unbiased=False).mean() + self.pos_emb.weight.var(-1).mean()
        return float(1.0 / var.clamp_min(1e-12))

    @torch.no_grad()
    def init_prior_from_frequency(self, item_frequency: Tensor) -> None:
        """Apply ``prior_init="frequency"`` once the data's item counts are known."""
        if not isinstance(self.prior, PrecisionPrior) or self.prior_init == "constant":
            return
        counts = torch.zeros(self.prior.log_tau.num_embeddings)
        n = min(len(item_frequency), len(counts))
        counts[:n] = item_frequency[:n].float()
        scale = math.exp(self.prior.log_tau.weight[1:].mean().item())
        self.prior.reset(self.prior_init, scale, counts)

    # -- views of a batch ---------------------------------------------------------------
    def train_view(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
        """(input ids (B, L), labels (B, L) with 0 = no loss, timestamps or None).

        A batch with ``num_targets`` ``(B,)`` (prefix rows) keeps labels only at
        each row's last ``num_targets`` positions.
        """
        seq = batch["seq"]
        times = batch.get("seq_time")
        inputs = seq[:, :-1]
        labels = seq[:, 1:] * (inputs != 0)  # no target for a position whose input is padding
        num_targets = batch.get("num_targets")  # prefix rows: only the last positions count
        if num_targets is not None:
            pos = torch.arange(labels.shape[1], device=labels.device)
            labels = labels * (pos >= labels.shape[1] - num_targets.unsqueeze(1))
        return inputs, labels, None if times is None else times[:, :-1]

    def eval_view(self, input_ids: Tensor) -> Tensor:
        """Input ids whose last position predicts the next item."""
        return input_ids

    # -- forward ------------------------------------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        """(B, L) ids -> (B, L, d) layer-0 state ``h0``."""
        if ids.shape[1] > self.max_len:  # positions past max_len would share one embedding
            raise ValueError(f"input width {ids.shape[1]} exceeds max_len={self.max_len}")
        if self.positions == "from_start":  # index from the row's first item (left padding)
            pos = ((ids != 0).long().cumsum(1) - 1).clamp_min(0)  # (B, L)
        else:  # distance from the row's last position, as SASRec's left-padded window
            pos = torch.arange(ids.shape[1], device=ids.device) + (self.max_len - ids.shape[1])
        h = self.item_emb(ids) * self.embedding_scale() + self.pos_emb(pos.clamp_min(0))
        return self.emb_dropout(h) * (ids != 0).unsqueeze(-1)

    def layer0_precision(self, ids: Tensor) -> Tensor | None:
        """(B, L, width) layer-0 ``log tau``, -inf at padding; None in off mode."""
        if self.prior is None:
            return None
        if isinstance(self.prior, MLPPrecisionPrior):
            return self.prior(self.item_emb(ids).detach(), ids != 0)
        return self.prior(ids)

    def run_encoder(
        self, h0: Tensor, ids: Tensor, times: Tensor | None, last_only: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The encoder stack over ``h0`` (B, L, d): the final states before the final
        norm and their log-precision, or None. HSTU overrides it to pass the times."""
        return self.encoder(
            h0, src_key_padding_mask=ids == 0, is_causal=self.causal,
            log_precision=self.layer0_precision(ids), return_precision=True,
            last_only=last_only,
        )  # fmt: skip

    def encoded(self, ids: Tensor, times: Tensor | None = None, last_only: bool = False) -> Encoded:
        """(B, L) ids -> :class:`Encoded`: the normalised states (B, L, d), the final
        log-precision (B, L, G) or None, and the final norm's scale at the last
        position (B,). ``last_only``: (B, 1, ...), the last layer computing its
        query, update and FFN for that position alone (the same values)."""
        h, lp = self.run_encoder(self.embed(ids), ids, times, last_only)
        last = h[:, -1].detach().float()
        scale = (last.var(-1, unbiased=False) + self.final_norm.eps).sqrt()
        return Encoded(self.final_norm(h), lp, scale)

    def encode(
        self, ids: Tensor, times: Tensor | None = None, last_only: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """(B, L) ids -> hidden states (B, L, d) and final log-precision (B, L, G) or None.

        ``last_only``: the last position's only, (B, 1, d) and (B, 1, G): the last
        layer computes its query, update and FFN for that position alone (the
        same values; what evaluation and serving read, see :meth:`last_hidden`).
        """
        out = self.encoded(ids, times, last_only)
        return out.hidden, out.log_precision

    def item_weights(self) -> Tensor:
        """(num_items + 1, d) output embeddings; row 0 (padding) is never a candidate."""
        return self.item_emb.weight[: self.num_items + 1]

    def output_transform(self, hidden: Tensor) -> Tensor:
        """Head transform before the dot product (identity; BERT4Rec has its own)."""
        return hidden

    def output_bias(self, items: Tensor | None) -> Tensor | float:
        """Per-item output bias (none by default)."""
        return 0.0

    def item_bias(self) -> Tensor | None:
        """(num_items + 1,) per-item score bias as a tensor, or None when there is none
        (``output_bias`` may give a constant; 0 means none)."""
        raw = self.output_bias(None)
        if isinstance(raw, Tensor):
            return raw
        if raw == 0:
            return None
        weights = self.item_weights()
        return weights.new_full((weights.shape[0],), float(raw))

    def output_scale(self, log_prec: Tensor | None) -> Tensor | None:
        """(N, 1) per-row multiplier of the scores (``head="precision"``), else None.

        ``exp(temperature(log_prec))`` in float32 (float64 for a float64 model),
        padding's -inf read as 0.
        """
        if self.head != "precision" or log_prec is None:
            return None
        dtype = torch.promote_types(self.temperature.weight.dtype, torch.float32)
        lp = torch.nan_to_num(log_prec.to(dtype), neginf=0.0)
        return torch.exp(self.temperature(lp))

    def score(
        self, hidden: Tensor, log_prec: Tensor | None = None, items: Tensor | None = None
    ) -> Tensor:
        """Scores of items for each state.

        hidden: (N, d); log_prec: (N, G) final precision or None; items: (N, k)
        candidate ids, or None for all items, giving (N, num_items + 1) with
        column 0 (padding) at -inf.
        """
        h = self.output_transform(hidden)
        scaled = self.head == "precision" and log_prec is not None
        bias = self.output_bias(items)
        # under autocast, or for half-precision states, the bias is added after the
        # (low-precision) product, so that a float32 bias stays float32
        fused = (
            not scaled
            and not torch.is_autocast_enabled(h.device.type)
            and h.dtype in (torch.float32, torch.float64)
        )
        if items is None and fused:
            # one product with the bias added inside it (as nn.Linear), the padding
            # column's -inf riding in the bias: over (N, num_items + 1) logits (the
            # largest tensors of a training step) no separate pass adds the bias, and
            # no in-place write of the column, whose backward copies the whole gradient
            weights = self.item_weights()
            row = torch.zeros(weights.shape[0], dtype=h.dtype, device=h.device) + bias
            row = torch.cat([row.new_full((1,), float("-inf")), row[1:]])
            return F.linear(h, weights, row.to(h.dtype))
        if items is None:
            logits = h @ self.item_weights().t()
        else:
            logits = (self.item_emb(items) * h.unsqueeze(-2)).sum(-1)  # (N, k)
        logits = logits + bias
        if scaled:
            logits = logits * self.output_scale(log_prec).to(logits.dtype)  # type: ignore[union-attr]
        if items is None:
            logits[..., 0] = float("-inf")
        return logits

    def last_hidden(
        self, input_ids: Tensor, times: Tensor | None = None, last_only: bool | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Evaluation: the state that predicts the next item, (B, d), and its
        log-precision (B, G) or None (:meth:`last_encoded` with its norm scale)."""
        out = self.last_encoded(input_ids, times, last_only)
        return out.hidden, out.log_precision

    def last_encoded(
        self, input_ids: Tensor, times: Tensor | None = None, last_only: bool | None = None
    ) -> Encoded:
        """Evaluation: :class:`Encoded` at the predicting position, (B, d), (B, G) or
        None, (B,): what scoring and the confidence read.

        ``last_only`` (default: in eval mode, unless a callback records the last
        layer at every position, ``record_all_positions``, or its attention)
        computes the last layer for the predicting position only
        (:meth:`encoded`); False runs every position, True forces the short path.
        """
        ids = self.eval_view(input_ids)
        if times is not None and times.shape != ids.shape:  # a mask token was appended
            times = torch.cat([times[:, -(ids.shape[1] - 1) :], times[:, -1:]], dim=1)
        if last_only is None:
            layer = self._last_layer()
            last_only = not self.training and not (
                getattr(layer, "record_attention", False)
                or getattr(layer, "record_all_positions", False)
            )
        out = self.encoded(ids, times, last_only=last_only)
        lp = None if out.log_precision is None else out.log_precision[:, -1]
        return Encoded(out.hidden[:, -1], lp, out.norm_scale)


def fold_flat_filter_options(init_args: Any, stated: Collection[str] = ()) -> None:
    """A command line's flat filter options over a config file's ``filter:`` block.

    ``init_args``: a backbone's parsed arguments (a jsonargparse ``Namespace``).
    A shipped config gives ``filter: {precision: "on", ...}``; a command line such
    as ``--model.init_args.backbone.init_args.q_init=0.1`` (the spelling of many
    recorded runs) gives a flat option beside it. The later source wins, as for
    any other option: each flat option that differs from its default moves into
    the block (checked there, when the model is built) and goes back to its
    default, so the model receives one form; ``stated`` names the flat options the
    user gave explicitly, which move even when equal to their default (``precision=off``
    over a block's ``on``). Without a ``filter`` block the flat
    options stay as they are (``FilterConfig.from_flat`` reads them).
    """
    block = init_args.get("filter") if init_args is not None else None
    if block is None:
        return
    for name, default in FLAT_FILTER_DEFAULTS.items():
        value = init_args.get(name, default)
        if value != default or name in stated:  # stated: given on the command line
            block[name] = value
            init_args[name] = default


def _check_options(num_items: int, max_len: int, prior: str, prior_init: str, head: str) -> None:
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if prior not in PRIOR_KINDS:
        raise ValueError(f"prior must be one of {PRIOR_KINDS}, got {prior!r}")
    if prior_init not in PRIOR_INITS:
        raise ValueError(f"prior_init must be one of {PRIOR_INITS}, got {prior_init!r}")
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")


# the flat filter keywords of SequentialRecommender and their defaults
FLAT_FILTER_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(SequentialRecommender.__init__).parameters.items()
    if name in FILTER_FIELDS
}
