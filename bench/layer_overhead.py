"""Cost of BFT over the plain layer: parameters, forward+backward time, peak memory.

For each shape, builds one layer with ``precision`` off and on (same
weights): the recommenders' ``BFTEncoderLayer`` (``--arch encoder``, dropout
0.1) or the LM's ``BFTLlamaDecoderLayer`` (``--arch llama``: GQA with H / 4
KV heads, SwiGLU, RoPE, no dropout), times forward + backward in interleaved
repetitions (off, on, off, on, ...) and reports medians and the on/off ratios. Memory is
the peak on CUDA (``torch.cuda.max_memory_allocated``) and on a CPU, where
PyTorch keeps no allocator statistics, the bytes of activations saved for
backward (what a step holds between forward and backward; not its transient
peak).

    OMP_WAIT_POLICY=PASSIVE python bench/layer_overhead.py            # the default shapes
    OMP_WAIT_POLICY=PASSIVE python bench/layer_overhead.py --off-impl reference
    OMP_WAIT_POLICY=PASSIVE python bench/layer_overhead.py --on-impl chunked --shapes 2,4096,256,4
    OMP_WAIT_POLICY=PASSIVE python bench/layer_overhead.py --arch llama --shapes 1,2048,256,8

``--off-impl sdpa`` (default) gives the off twin PyTorch's fused attention,
which is what a user of ``nn.TransformerEncoderLayer`` gets. ``--on-impl``
picks the BFT path: ``reference`` (materialised weights) or ``chunked``
(query blocks of ``--chunk``, no (T x T) weights kept for backward).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch import nn

from bft_lightning.nn import BFTEncoder, BFTEncoderLayer
from bft_lightning.nn import functional_llama as FL
from bft_lightning.nn.decoder import BFTLlamaDecoderLayer
from bft_lightning.nn.filter import FilterConfig

SHAPES = [(128, 50, 64, 2), (64, 200, 64, 2), (8, 1024, 256, 4), (2, 4096, 256, 4)]


class LlamaLayer(nn.Module):
    """One BFT Llama decoder layer (GQA with H / 4 KV heads, SwiGLU of width 8d/3, RoPE,
    no dropout, as in LM fine-tuning) behind the encoder's call signature."""

    def __init__(self, d: int, h: int, precision: str, impl: str, chunk: int) -> None:
        super().__init__()
        self.layer = BFTLlamaDecoderLayer(
            d, h, max(1, h // 4), d_ff=8 * d // 3,
            config=FilterConfig(precision=precision, attention_impl=impl, attention_chunk=chunk),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, src_key_padding_mask: torch.Tensor, is_causal: bool = True):  # type: ignore[no-untyped-def]
        valid = ~src_key_padding_mask
        pos = (valid.long().cumsum(1) - 1).clamp_min(0)  # positions of the valid tokens
        rope = FL.rope_tables(pos, self.layer.self_attn.head_dim, 10000.0, x.dtype)
        return self.layer(x, None, rope, valid)[0]


def build(
    d: int,
    h: int,
    precision: str,
    impl: str,
    device: str,
    chunk: int = 256,
    arch: str = "encoder",
    dropout: float = 0.1,
) -> nn.Module:
    if arch == "llama":
        return LlamaLayer(d, h, precision, impl, chunk).to(device).train()
    layer = BFTEncoderLayer(d, h, 4 * d, dropout=dropout, activation="gelu", precision=precision,
                            attention_impl=impl, attention_chunk=chunk)  # fmt: skip
    return BFTEncoder(layer, 1).to(device).train()


def step(model: nn.Module, x: torch.Tensor, pad: torch.Tensor | None) -> None:
    y = model(x, src_key_padding_mask=pad, is_causal=True)
    y.square().mean().backward()  # type: ignore[union-attr]


def timed(model: nn.Module, x: torch.Tensor, pad: torch.Tensor | None, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    step(model, x, pad)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def peak_memory(model: nn.Module, x: torch.Tensor, pad: torch.Tensor | None, device: str) -> float:
    """CUDA: peak bytes allocated during one step above the baseline. CPU (no
    allocator statistics): bytes of the distinct storages saved for backward,
    which is what sets the activation memory of training."""
    gc.collect()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model, x, pad)
        return float(torch.cuda.max_memory_allocated() - base)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x, src_key_padding_mask=pad, is_causal=True)
    y.square().mean().backward()  # type: ignore[union-attr]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return float(
        sum(
            n
            for ptr, n in storages.items()
            if ptr not in params and ptr != x.untyped_storage().data_ptr()
        )
    )


def measure(
    shape: tuple[int, int, int, int], reps: int, off_impl: str, on_impl: str, chunk: int,
    device: str, compile_: bool = False, arch: str = "encoder", dropout: float = 0.1,
    padded: bool = True,
) -> dict:  # fmt: skip
    """Median forward + backward time and memory of the off / on twins. ``padded``
    False runs without a padding mask (the causal mask only); ``dropout`` is the
    encoder layer's rate (the Llama layer has none)."""
    b, t, d, h = shape
    torch.manual_seed(0)
    models = {
        "off": build(d, h, "off", off_impl, device, arch=arch, dropout=dropout),
        "on": build(d, h, "on", on_impl, device, chunk, arch, dropout),
    }
    models["on"].load_state_dict(models["off"].state_dict(), strict=False)
    if compile_:  # both twins compiled alike (inductor fuses the filter's elementwise work)
        torch._dynamo.reset()
        models = {name: torch.compile(m) for name, m in models.items()}
    x = torch.randn(b, t, d, device=device)
    lengths = torch.randint(t // 4, t + 1, (b,), device=device)
    pad = torch.arange(t, device=device).unsqueeze(0) >= lengths.unsqueeze(1) if padded else None
    for m in models.values():  # warm-up (compiled: the graphs are built in the first calls)
        for _ in range(3 if compile_ else 1):
            step(m, x, pad)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(reps):
        # alternating order: a step right after the other twin's runs in the state
        # that step left (caches, freed memory), which a fixed order gives one twin only
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            m = models[name]
            m.zero_grad(set_to_none=True)
            times[name].append(timed(m, x, pad, device))
    mem = {name: peak_memory(m, x, pad, device) for name, m in models.items()}
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"shape": shape, "params": params, "time": med, "mem": mem}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--off-impl", default="sdpa", choices=["sdpa", "reference"])
    p.add_argument("--on-impl", default="chunked", choices=["chunked", "blockwise", "reference"])
    p.add_argument("--chunk", type=int, default=256, help="query block of the chunked path")
    p.add_argument("--shapes", nargs="+", default=None, help="B,T,d,H (default: all four)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="time both twins under torch.compile")
    p.add_argument(
        "--arch", default="encoder", choices=["encoder", "llama"],
        help="encoder: the recommenders' layer; llama: the LM decoder layer",
    )  # fmt: skip
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes] if args.shapes else SHAPES
    print(f"device={args.device} threads={torch.get_num_threads()} off_impl={args.off_impl} "
          f"on_impl={args.on_impl} chunk={args.chunk} compile={args.compile} "
          f"arch={args.arch}")  # fmt: skip
    print("| B, T, d, H | params off | params on | ms off | ms on | time on/off | "
          "MB off | MB on | mem on/off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        r = measure(
            shape, args.reps, args.off_impl, args.on_impl, args.chunk, args.device, args.compile,
            args.arch,
        )  # fmt: skip
        t, m, n = r["time"], r["mem"], r["params"]
        print(
            f"| {shape} | {n['off']:,} | {n['on']:,} | {1e3 * t['off']:.1f} | {1e3 * t['on']:.1f} "
            f"| {t['on'] / t['off']:.2f} | {m['off'] / 2**20:.1f} | {m['on'] / 2**20:.1f} "
            f"| {m['on'] / max(m['off'], 1):.2f} |"
        )


if __name__ == "__main__":
    main()
