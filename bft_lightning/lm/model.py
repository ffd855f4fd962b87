"""A Llama-style causal LM whose layers are BFT decoder layers.

``LlamaForCausalLM`` mirrors the parameter names of ``transformers``'
``LlamaForCausalLM`` (``model.embed_tokens``, ``model.layers.i.self_attn.q_proj``,
..., ``model.norm``, ``lm_head``), so a Llama-format checkpoint loads by name
(:meth:`LlamaForCausalLM.from_pretrained`, local files only). With
``precision="off"`` it computes what ``transformers`` computes.

Precision (``precision="on"``):

- Layer 0 starts from a per-token prior ``tau`` (:class:`PrecisionPrior`, one
  ``log tau`` per vocabulary id, width 1 or ``G``).
- The last layer has no process noise: its ``lambda''`` feeds nothing (the LM
  head reads the state only), so its ``Q`` would get no gradient. Every other
  layer's ``rho`` and the prior get gradients through later layers' kriging
  bias and gain.
- From scratch (``LlamaForCausalLM(config, bft)``): ``tau`` is constant with
  ``c = 1 / mean Var(h0)`` (the embedding init), ``Q0 = bft.filter.q_init``.
- From a pretrained checkpoint, :func:`calibrate_precision` on one batch makes
  BFT start close to the pretrained model; see its docstring for the rule.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from bft_lightning.lm import llama_format as ckpt
from bft_lightning.lm.config import (
    GATE_BIAS_PRETRAINED,
    LlamaConfig,
    check_llama_tensors,
    is_bft_key,
    llama_tensor_shapes,
)
from bft_lightning.lm.options import BFTOptions
from bft_lightning.lm.precision_calibration import CalibrationReport, calibrate_precision
from bft_lightning.nn import functional as BF
from bft_lightning.nn import functional_llama as FL
from bft_lightning.nn.decoder import BFTLlamaDecoderLayer, LayerCache, RMSNorm
from bft_lightning.nn.filter import run_stack

__all__ = [
    "GATE_BIAS_PRETRAINED",
    "BFTOptions",
    "CalibrationReport",
    "CausalLMOutput",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "calibrate_precision",
    "check_llama_tensors",
    "is_bft_key",
    "llama_tensor_shapes",
]
from bft_lightning.nn.prior import PrecisionPrior


@dataclass
class KVCache:
    """Per-layer caches plus the next RoPE position of each sequence (B,)."""

    layers: list[LayerCache]
    positions: Tensor

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


@dataclass
class CausalLMOutput:
    """logits: (B, T, V); log_precision: (B, T, G) after the last layer (None when off)."""

    logits: Tensor
    log_precision: Tensor | None = None
    cache: KVCache | None = None


class LlamaModel(nn.Module):
    """Embedding, BFT decoder layers and the final RMSNorm (no head)."""

    def __init__(self, config: LlamaConfig, bft: BFTOptions | None = None) -> None:
        super().__init__()
        bft = bft or BFTOptions()
        self.config, self.bft = config, bft
        n = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            BFTLlamaDecoderLayer(
                d_model=config.hidden_size,
                n_heads=config.num_attention_heads,
                n_kv_heads=config.num_key_value_heads,
                d_ff=config.intermediate_size,
                head_dim=config.head_dim,
                rms_norm_eps=config.rms_norm_eps,
                attention_bias=config.attention_bias,
                mlp_bias=config.mlp_bias,
                dropout=bft.dropout,
                config=bft.filter_config(predict_noise=i < n - 1),
            )
            for i in range(n)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.head_dim = int(config.head_dim or config.hidden_size // config.num_attention_heads)
        self.groups = self.layers[0].groups
        self.prior: PrecisionPrior | None = None
        if bft.precision == "on":
            if bft.prior_width not in (1, self.groups):
                raise ValueError(f"prior_width must be 1 or G={self.groups}, got {bft.prior_width}")
            self.prior = PrecisionPrior(config.vocab_size, bft.prior_width, padding_idx=None)

    @property
    def precision(self) -> str:
        return self.bft.precision

    @property
    def decoder_layers(self) -> list[BFTLlamaDecoderLayer]:
        return cast(list[BFTLlamaDecoderLayer], list(self.layers))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor | None, KVCache]:
        """input_ids, attention_mask: (B, T) (mask 1 = token, 0 = padding).

        With ``cache``, ``input_ids`` are the positions after the cached ones.
        Returns the normed final state (B, T, d), the final log precision
        (B, T, G) or None, and the cache including these positions.
        """
        b, t = input_ids.shape
        valid = (
            torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
            if attention_mask is None
            else attention_mask.bool()
        )
        start = cache.positions if cache is not None else input_ids.new_zeros(b)
        positions = (start.unsqueeze(1) + valid.long().cumsum(1) - 1).clamp_min(0)  # (B, T)
        h = self.embed_tokens(input_ids)  # (B, T, d)
        rope = FL.rope_tables(positions, self.head_dim, self.config.rope_theta, h.dtype)
        lp = None
        if self.prior is not None:
            lp = self.prior(input_ids).expand(b, t, self.groups)
            lp = BF.with_padding(lp, valid)
        new_layers: list[LayerCache] = []

        def step(i: int, layer: BFTLlamaDecoderLayer, h: Tensor, lp: Tensor | None, _: bool):  # type: ignore[no-untyped-def]
            past = cache.layers[i] if cache is not None else None
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                h, lp, layer_cache = checkpoint(
                    layer, h, lp, rope, valid, past, use_reentrant=False
                )
            else:
                h, lp, layer_cache = layer(h, lp, rope, valid, past)
            new_layers.append(layer_cache)
            return h, lp

        h, lp = run_stack(self.decoder_layers, h, lp, step)
        new_cache = KVCache(new_layers, start + valid.long().sum(1))
        return self.norm(h), lp, new_cache


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head; ``generate`` does greedy decoding (KV cache or not).

    Set ``model.model.gradient_checkpointing = True`` to recompute each layer in
    the backward pass. With the default ``attention_impl="chunked"`` no layer
    keeps (T x T) attention weights for the backward (only a (B, 1, T, T)
    boolean mask), so activation memory is O(L B T d); with ``"sdpa"`` or
    ``"reference"`` an on-mode layer keeps its (B, H, T, T) float32 weights,
    O(L B H T^2). (A recomputed layer does not update its running sill again.)

    Args:
        config: the architecture.
        bft: the BFT options (precision, gate, groups, ...).
    """

    def __init__(self, config: LlamaConfig, bft: BFTOptions | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, bft)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # whether every BFT tensor came from a saved model, and which did (:meth:`load_bft_state`)
        self.bft_state_loaded = False
        self.bft_loaded_keys: list[str] = []
        if not self.lm_head.weight.is_meta:
            self.reset_parameters()

    @property
    def bft(self) -> BFTOptions:
        return self.model.bft

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self, llama_weights: bool = True) -> None:
        """Llama's init (normal(0, initializer_range), norms 1) and the from-scratch BFT state.

        ``llama_weights=False`` resets only the BFT parameters (``rho``, sill,
        gate, prior), e.g. before loading a checkpoint's Llama weights.
        """
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if not llama_weights and not name.endswith("attn_gate"):
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for layer in self.model.decoder_layers:
            layer.reset_filter_state()
        self.tie_weights()
        prior = self.model.prior
        if prior is not None and not llama_weights:
            prior.reset("constant", 1.0)  # placeholder until the checkpoint is loaded
        elif prior is not None:
            scale = self.bft.prior_scale
            if scale is None:  # c = 1 / mean Var(h0), in RMSNorm units (mean square)
                scale = 1.0 / float(self.model.embed_tokens.weight.float().square().mean())
            prior.reset("constant", scale)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = False,
        last_only: bool = False,
    ) -> CausalLMOutput:
        """input_ids, attention_mask: (B, T). Returns logits (B, T, V) (with
        ``last_only``, (B, 1, V) of the last position: what generation reads,
        without a (B, T, V) tensor for a long prompt) and, with ``use_cache`` (or
        a ``cache`` given), the cache extended by these positions."""
        h, lp, new_cache = self.model(input_ids, attention_mask, cache)
        logits = self.lm_head(h[:, -1:] if last_only else h)
        keep = use_cache or cache is not None
        return CausalLMOutput(logits, lp, new_cache if keep else None)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 32,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Greedy decoding of left-padded prompts (B, P) -> new tokens (B, N <= max_new_tokens).

        After a sequence emits ``eos_token_id`` it is filled with ``pad_token_id``
        (default: the EOS id); decoding stops when every sequence has ended.
        """
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            raise ValueError("generate needs left-padded prompts (attention_mask[:, -1] all 1)")
        b = input_ids.shape[0]
        eos = eos_token_id if eos_token_id is not None else self.config.eos_token_id
        pad = pad_token_id if pad_token_id is not None else (eos if eos is not None else 0)
        mask = (
            attention_mask.long()
            if attention_mask is not None
            else torch.ones_like(input_ids, dtype=torch.long)
        )
        ids = input_ids
        out = self(ids, mask, use_cache=use_cache, last_only=True)
        finished = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        new: list[Tensor] = []
        ones = mask.new_ones(b, 1)
        for step in range(max_new_tokens):
            nxt = out.logits[:, -1].argmax(-1)
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            new.append(nxt)
            if eos is not None:
                finished = finished | (nxt == eos)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            if use_cache:
                out = self(nxt.unsqueeze(1), ones, cache=out.cache)
            else:
                ids, mask = torch.cat((ids, nxt.unsqueeze(1)), 1), torch.cat((mask, ones), 1)
                out = self(ids, mask, last_only=True)
        if not new:
            return input_ids.new_zeros(b, 0)
        return torch.stack(new, dim=1)

    # ------------------------------------------------------------- checkpoints
    def load_llama_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load Llama weights by name; the BFT tensors (prior, rho, sill, gate) may be absent.

        Raises on any other missing or unexpected key.
        """
        sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not is_bft_key(k)]
        if self.config.tie_word_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the config: missing {missing[:8]}, "
                f"unexpected {list(unexpected)[:8]}"
            )
        self.tie_weights()

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        bft: BFTOptions | None = None,
        dtype: torch.dtype | None = torch.float32,
    ) -> LlamaForCausalLM:
        """Build from a local Llama-format directory (``config.json`` + safetensors).

        ``bft`` None takes the options a BFT model saved with
        :meth:`save_pretrained` (``bft_options.json``), else the defaults
        (``precision="off"``). The BFT tensors saved there (``bft.safetensors``)
        are loaded where the model has them (a tensor the options do not use,
        e.g. the prior under ``precision="off"``, is left out with a warning;
        one of another shape is an error). BFT parameters the directory lacks
        start as follows: the prior is uniform in RMSNorm units per token id
        (``log tau_i = -2 log rms(e_i)``, which by the delta rule leaves layer-0
        attention exactly softmax); a sigmoid gate starts nearly open (weight 0,
        bias ``GATE_BIAS_PRETRAINED``). Then call :func:`calibrate_precision` on
        a batch before training to set ``c``, ``Q`` and the sill (``LanguageSFT``
        does this on its first batch, unless :attr:`bft_state_loaded`: every BFT
        tensor came from the directory).
        """
        config_file = Path(directory).expanduser() / ckpt.CONFIG_FILE
        raw = ckpt.read_config(directory)
        try:
            config = LlamaConfig.from_hf(raw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{config_file}: {e}") from e
        saved_options, saved_state = ckpt.read_bft_state(directory)
        if bft is None and saved_options is not None:
            options_file = Path(directory) / ckpt.BFT_OPTIONS_FILE
            try:  # older exports wrote the filter options flat
                bft = BFTOptions.from_dict(saved_options)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{options_file}: {e}") from e
        headers = ckpt.tensor_headers(directory)
        if headers is not None:  # safetensors: checked before any tensor is read
            check_llama_tensors(config, headers, config_file)
        state, source = ckpt.read_weights(directory, dtype)
        if headers is None:  # pytorch_model.bin: the shapes are known once loaded
            infos = {k: ckpt.TensorInfo(tuple(v.shape), str(v.dtype), source[k])
                     for k, v in state.items()}  # fmt: skip
            check_llama_tensors(config, infos, config_file)
        ckpt.check_finite(state, source)
        with torch.device("meta"):
            model = cls(config, bft)
        model = model.to_empty(device="cpu")
        model.reset_parameters(llama_weights=False)  # the Llama weights come from the file
        model.load_llama_state_dict(state)
        if dtype is not None:
            model = model.to(dtype)
        model.init_bft_from_pretrained()
        model.load_bft_state(saved_state, Path(directory) / ckpt.BFT_WEIGHTS_FILE)
        return model

    @torch.no_grad()
    def load_bft_state(self, tensors: dict[str, Tensor], source: str | Path = "BFT state") -> None:
        """Copy saved BFT tensors (:meth:`bft_state`) into the model's own.

        Sets :attr:`bft_state_loaded` when the model has BFT tensors and all of
        them were given, and :attr:`bft_loaded_keys` to those that were. A tensor
        the model does not have is left out with a warning; one of another shape
        raises, naming ``source`` and the entry.
        """
        own = self.bft_state()
        unused = sorted(k for k in tensors if k not in own)
        if unused:
            warnings.warn(
                f"{source}: {len(unused)} BFT tensors that this model's options do not use "
                f"were not loaded ({', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}); "
                f"options: precision={self.bft.precision!r}, "
                f"attention_gate={self.bft.filter.attention_gate!r}",
                stacklevel=2,
            )
        for name, value in tensors.items():
            if name not in own:
                continue
            if own[name].shape != value.shape:
                raise ValueError(
                    f"{source}: {name} has shape {tuple(value.shape)}, but the model's is "
                    f"{tuple(own[name].shape)} (other BFT options, e.g. groups or prior_width?)"
                )
            own[name].copy_(value)
        self.bft_loaded_keys = sorted(k for k in tensors if k in own)
        self.bft_state_loaded = bool(own) and all(k in tensors for k in own)

    def bft_state(self) -> dict[str, Tensor]:
        """The model's BFT tensors (prior, ``rho``, sill, gate) by state-dict name."""
        return {k: v for k, v in self.state_dict(keep_vars=True).items() if is_bft_key(k)}

    @torch.no_grad()
    def init_bft_from_pretrained(self) -> None:
        """Start the BFT parameters of a loaded model near the pretrained behaviour."""
        for layer in self.model.decoder_layers:
            gate = layer.self_attn.attn_gate
            if gate is not None:
                nn.init.zeros_(gate.weight)
                nn.init.constant_(gate.bias, GATE_BIAS_PRETRAINED)
        prior = self.model.prior
        if prior is not None:
            log_rms2 = (
                2.0
                * torch.log(
                    BF.norm_sigma(
                        self.model.embed_tokens.weight[None], self.config.rms_norm_eps, True
                    )
                )[0]
            )  # (V,)
            prior.log_tau.weight.copy_(-log_rms2.unsqueeze(1).expand_as(prior.log_tau.weight))

    def save_pretrained(self, directory: str | Path, max_shard_bytes: int | None = None) -> None:
        """Write ``config.json`` and the Llama weights as safetensors (a directory
        that Llama readers, ``transformers`` included, load as the plain model),
        plus the BFT options (``bft_options.json``) and, when the model has any,
        its BFT tensors (``bft.safetensors``), from which :meth:`from_pretrained`
        rebuilds this model exactly. The sill is flushed first (its pending
        statistics would otherwise be lost)."""
        for layer in self.model.decoder_layers:
            layer.flush_sill()
        state = self.state_dict()
        llama = {k: v for k, v in state.items() if not is_bft_key(k)}
        if self.config.tie_word_embeddings:
            llama.pop("lm_head.weight", None)
        ckpt.write_checkpoint(
            directory,
            self.config.to_hf(),
            llama,
            max_shard_bytes,
            bft_options=self.bft.to_dict(),
            bft_state={k: v for k, v in state.items() if is_bft_key(k)},
        )
