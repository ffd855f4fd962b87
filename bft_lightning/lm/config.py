"""The Llama ``config.json`` fields (``LlamaConfig``) and the checks of a checkpoint's
tensors against them, before anything is allocated (``models.llama`` loads by them).

Shapes name the config fields: ``d`` ``hidden_size``, ``F`` ``intermediate_size``,
``H`` / ``Hkv`` the attention / key-value heads, ``d_h`` ``head_dim``, ``V`` ``vocab_size``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from bft_lightning.lm import llama_format as ckpt
from bft_lightning.nn.checks import check_int, check_number, check_sizes

GATE_BIAS_PRETRAINED = 4.0  # sigmoid(4) = 0.982: a new gate on a loaded model starts near open
# the state-dict entries that a Llama checkpoint lacks: the BFT filter state and the gate
_BFT_KEYS = (".rho", ".sill", "model.prior.", ".attn_gate.")


def is_bft_key(name: str) -> bool:
    """Whether a state-dict entry belongs to BFT (prior, ``rho``, sill, gate), not to Llama."""
    return any(s in name for s in _BFT_KEYS)


def llama_tensor_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every Llama tensor (no BFT ones) that ``cfg`` implies, by state-dict
    name, computed from the sizes alone (nothing is built); no ``lm_head`` when tied."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, int(cfg.head_dim or 0)
    q, kv = cfg.num_attention_heads * hd, int(cfg.num_key_value_heads or 0) * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"{p}self_attn.{name}_proj.weight"] = (rows, d)
            if cfg.attention_bias:
                out[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (d, q)
        if cfg.attention_bias:
            out[p + "self_attn.o_proj.bias"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        for name, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            out[f"{p}mlp.{name}_proj.weight"] = shape
            if cfg.mlp_bias:
                out[f"{p}mlp.{name}_proj.bias"] = shape[:1]
    out["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def check_llama_tensors(
    cfg: LlamaConfig, stored: dict[str, ckpt.TensorInfo], config_file: Path
) -> None:
    """Check a checkpoint's stored tensors against the sizes of its ``config.json``.

    Reads shapes and dtypes only, so it runs before anything is allocated: the
    layer count first (``num_hidden_layers`` named), then every expected tensor
    present and no other (their names), each of the shape the config implies
    (the mismatching field named, with its value) and of a floating dtype.
    """
    stored = {k: v for k, v in stored.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        stored = {k: v for k, v in stored.items() if k != "lm_head.weight"}
    folder = config_file.parent
    layer = re.compile(r"model\.layers\.(\d+)\.")
    stored_layers = {int(m.group(1)) for k in stored if (m := layer.match(k))}
    if len(stored_layers) != cfg.num_hidden_layers:
        raise ValueError(
            f"{config_file}: num_hidden_layers={cfg.num_hidden_layers} does not match the "
            f"weights in {folder}, which hold {len(stored_layers)} layers"
        )
    own = llama_tensor_shapes(cfg)
    missing = [k for k in own if k not in stored]
    unexpected = sorted(k for k in stored if k not in own)
    if missing or unexpected:
        raise ValueError(
            f"{folder}: the weights do not match {config_file.name}: missing tensors "
            f"{missing[:6]}{' ...' if len(missing) > 6 else ''}, unexpected "
            f"{unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
        )
    for name, shape in own.items():
        info = stored[name]
        if info.shape != shape:
            dims = _shape_fields(name, cfg)
            i = next((j for j, (a, b) in enumerate(zip(shape, info.shape)) if a != b), len(dims))
            field_ = dims[i] if i < len(dims) else "the sizes"
            raise ValueError(
                f"{config_file}: {field_} does not match tensor {name} of shape "
                f"{info.shape} in {info.file.name} (the config implies {shape}); "
                "nothing was allocated"
            )
        if not info.is_float:
            raise ValueError(
                f"{info.file}: tensor {name} has dtype {info.dtype}; Llama weights must "
                "be floating point"
            )


def _shape_fields(name: str, cfg: LlamaConfig) -> tuple[str, ...]:
    """The ``config.json`` fields that set each dimension of a Llama tensor, with values."""
    d = f"hidden_size={cfg.hidden_size}"
    q = f"num_attention_heads x head_dim={cfg.num_attention_heads} x {cfg.head_dim}"
    kv = f"num_key_value_heads x head_dim={cfg.num_key_value_heads} x {cfg.head_dim}"
    f = f"intermediate_size={cfg.intermediate_size}"
    table = {
        "embed_tokens.weight": (f"vocab_size={cfg.vocab_size}", d),
        "lm_head.weight": (f"vocab_size={cfg.vocab_size}", d),
        "q_proj.weight": (q, d), "q_proj.bias": (q,),
        "k_proj.weight": (kv, d), "k_proj.bias": (kv,),
        "v_proj.weight": (kv, d), "v_proj.bias": (kv,),
        "o_proj.weight": (d, q), "o_proj.bias": (d,),
        "gate_proj.weight": (f, d), "up_proj.weight": (f, d), "down_proj.weight": (d, f),
        "gate_proj.bias": (f,), "up_proj.bias": (f,), "down_proj.bias": (d,),
    }  # fmt: skip
    for suffix, dims in table.items():
        if name.endswith(suffix):
            return dims
    return (d,)  # the norms


@dataclass
class LlamaConfig:
    """The architecture, with the field names of a Llama ``config.json``.

    Args:
        vocab_size: vocabulary size.
        hidden_size: width ``d``.
        intermediate_size: SwiGLU width ``F``.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads ``H``.
        num_key_value_heads: key/value heads (GQA); None means ``H``.
        head_dim: per-head width; None means ``d / H``.
        max_position_embeddings: the longest context the model was trained for.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base (only the default RoPE, no scaling, is supported).
        attention_bias: biases on q/k/v/o.
        mlp_bias: biases on the SwiGLU projections.
        tie_word_embeddings: the LM head shares the embedding matrix.
        initializer_range: std of the normal init of a model built from scratch.
        bos_token_id: BOS id, or None.
        eos_token_id: EOS id, or None.
        pad_token_id: pad id, or None.
    """

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 22
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        check_sizes(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            max_position_embeddings=self.max_position_embeddings,
        )  # fmt: skip
        check_int("num_key_value_heads", self.num_key_value_heads, optional=True)
        check_int("head_dim", self.head_dim, optional=True)
        check_number("rms_norm_eps", self.rms_norm_eps, 0.0, low_open=True)
        check_number("rope_theta", self.rope_theta, 0.0, low_open=True)
        check_number("initializer_range", self.initializer_range, 0.0)
        for name in ("bos_token_id", "eos_token_id"):  # pad: some configs write -1
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value < self.vocab_size):  # fmt: skip
                raise ValueError(
                    f"{name} must be None or an id in [0, vocab_size={self.vocab_size}), "
                    f"got {value!r}"
                )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"num_attention_heads must divide hidden_size={self.hidden_size}, "
                    f"got num_attention_heads={self.num_attention_heads}"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")

    @classmethod
    def from_hf(cls, config: dict) -> LlamaConfig:
        """From a Llama ``config.json`` dict (transformers 4.x or 5.x layout)."""
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"only SwiGLU (hidden_act='silu') is supported, got {act!r}")
        # transformers 5 writes rope_parameters, 4.x rope_scaling; either may carry a type
        for key in ("rope_parameters", "rope_scaling"):
            part = config.get(key) or {}
            rope_type = part.get("rope_type") or part.get("type") or "default"
            if rope_type != "default":
                raise NotImplementedError(
                    f"RoPE type {rope_type!r} ({key}) is not supported (only the default RoPE)"
                )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in known}
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        theta = rope.get("rope_theta", config.get("rope_theta"))
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        return cls(**kwargs)

    def to_hf(self) -> dict:
        """A ``config.json`` dict that ``transformers.LlamaConfig`` reads."""
        out = asdict(self)
        out.update(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            rope_scaling=None,
            attention_dropout=0.0,
            pretraining_tp=1,
            use_cache=True,
        )
        return out
