"""Kernels one BFT layer launches per training step against its off twin.

For the recommenders' encoder layer (``BFTEncoderLayer``, dropout 0.1), the
LM's decoder layer (``BFTLlamaDecoderLayer``, GQA, SwiGLU, RoPE) and the HSTU
block (``HSTULayer``, dropout 0.1), with ``precision`` off and on (same
shapes, causal mask, left padding), one step = forward + ``y.square().mean()``
+ backward, in training mode, eager and under ``torch.compile`` (inductor).

Counting rule:

- CUDA: the CUDA kernels the profiler records during one step (device
  events of kind kernel; memcpy / memset included as the profiler lists them).
- CPU, eager: the ATen operators of one step that run a kernel themselves:
  not the ones that only make a view or an empty tensor (``view``,
  ``empty``, ``as_strided``, a ``to`` that returns its input, ...:
  :data:`NO_KERNEL`), and not the ones that only call others (an operator
  counts when no operator below it runs a kernel: ``to`` -> ``_to_copy`` ->
  ``copy_`` counts once; GEMMs and the fused SDPA kernel, :data:`SELF_KERNEL`,
  count whatever they call: ``addmm`` copies its bias with ``copy_``, then
  runs the GEMM, two kernels).
  Each counted operator runs one kernel (a loop over its tensor, or a BLAS call).
- CPU, compiled: the inductor-generated C++ kernels run during the step (one
  profiler event each, with ``torch._inductor.config.cpp.enable_kernel_profile``)
  plus the ATen operators the compiled code still calls, counted as in eager (extern kernels:
  ``mm``, ``addmm``, ``bmm``, the custom ops' bodies, ...), less
  :data:`NO_KERNEL` as in eager. The table also gives, for reference,
  ``torch._inductor.metrics.generated_kernel_count`` (kernels generated at
  compile time, forward and backward graphs, per model).

The twins: off runs PyTorch's SDPA (``attention_impl="sdpa"`` path of the off
layer); on runs ``--on-impls`` (default ``blockwise``, the kernel that
compiles without a graph break, and ``chunked``, the eager CPU default, whose
hand-written backward runs outside a compiled graph). HSTU has its own
pointwise attention and no kernel choice.

    OMP_NUM_THREADS=1 python bench/kernel_count.py --json results/perf/kernel_count.json \
        > results/perf/kernel_count.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layer_overhead as lo  # noqa: E402

from bft_lightning.nn import HSTUEncoder, HSTULayer  # noqa: E402
from bft_lightning.nn.filter import FilterConfig

ARCHS = ("encoder", "llama", "hstu")
# ATen leaf operators that make views, metadata or uninitialised storage: no kernel runs
NO_KERNEL = frozenset(
    "aten::" + n
    for n in (
        "empty empty_strided empty_like view _unsafe_view as_strided reshape alias t transpose "
        "permute expand expand_as unsqueeze squeeze select slice narrow unbind split chunk "
        "split_with_sizes detach detach_ lift_fresh resize_ set_ result_type unfold movedim "
        "_reshape_alias view_as diagonal numpy_T contiguous is_nonzero item _local_scalar_dense "
        "size stride dim is_same_size _has_compatible_shallow_copy_type real conj resolve_conj "
        "resolve_neg _conj _neg_view broadcast_tensors to"
    ).split()
)

# operators that run their own kernel (a GEMM, a fused attention) even when they also
# call others first (addmm copies its bias into the output, then runs the GEMM)
SELF_KERNEL = frozenset(
    "aten::" + n
    for n in (
        "mm addmm bmm baddbmm addbmm mv addmv dot _scaled_dot_product_flash_attention_for_cpu "
        "_scaled_dot_product_flash_attention_for_cpu_backward"
    ).split()
)


class HSTUBlock(nn.Module):
    """One HSTU block behind the encoder's call signature."""

    def __init__(self, d: int, h: int, t: int, precision: str) -> None:
        super().__init__()
        self.enc = HSTUEncoder(
            HSTULayer(d, h, t, dropout=0.1, config=FilterConfig(precision=precision)), 1
        )

    def forward(self, x: torch.Tensor, src_key_padding_mask: torch.Tensor, is_causal: bool = True):  # type: ignore[no-untyped-def]
        return self.enc(x, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)


def build(arch: str, d: int, h: int, t: int, precision: str, impl: str, device: str) -> nn.Module:
    if arch == "hstu":
        return HSTUBlock(d, h, t, precision).to(device).train()
    return lo.build(d, h, precision, impl, device, arch=arch)


def _leaf_ops(events: list) -> Counter:
    """ATen operators that run a kernel themselves, by name: not in :data:`NO_KERNEL`,
    and no operator below them runs one (``mm`` calling only ``resolve_conj`` counts;
    ``to`` calling ``_to_copy`` calling ``copy_`` counts once, as ``copy_``)."""
    memo: dict[int, bool] = {}

    def runs_kernel(e) -> bool:  # type: ignore[no-untyped-def]
        if not e.name.startswith("aten::") or e.name in NO_KERNEL:
            return False
        return e.name in SELF_KERNEL or not below(e)

    def below(e) -> bool:  # type: ignore[no-untyped-def]
        """Some operator under ``e`` runs a kernel."""
        if id(e) not in memo:
            memo[id(e)] = any(runs_kernel(c) or below(c) for c in e.cpu_children)
        return memo[id(e)]

    out: Counter = Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and runs_kernel(e):
            out[e.name] += 1
    return out


def count_step(model: nn.Module, x: torch.Tensor, pad: torch.Tensor, device: str) -> dict:
    """Kernels of one step, by the rule of the module docstring."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    model.zero_grad(set_to_none=True)
    with profile(activities=activities) as prof:
        lo.step(model, x, pad)
        if device == "cuda":
            torch.cuda.synchronize()
    events = list(prof.events())
    if device == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        return {"kernels": len(kernels)}
    generated = sum(1 for e in events if "cpp_fused" in e.name or "cpp_kernel" in e.name)
    leaf = _leaf_ops(events)
    return {
        "kernels": generated + sum(leaf.values()),
        "generated": generated,
        "aten": sum(leaf.values()),
        "ops": dict(leaf.most_common()),
    }


def run_case(arch: str, shape: tuple[int, int, int, int], precision: str, impl: str,
             compiled: bool, device: str) -> dict:  # fmt: skip
    b, t, d, h = shape
    torch.manual_seed(0)
    model = build(arch, d, h, t, precision, impl, device)
    x = torch.randn(b, t, d, device=device)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=torch.Generator().manual_seed(1))
    pad = torch.arange(t).unsqueeze(0) >= lengths.unsqueeze(1)
    pad = pad.to(device)
    compiled_count = None
    if compiled:
        from torch._inductor import metrics

        torch._dynamo.reset()
        metrics.reset()
        model = torch.compile(model)  # type: ignore[assignment]
        for _ in range(2):  # compile forward and backward
            lo.step(model, x, pad)
        compiled_count = metrics.generated_kernel_count
    else:
        lo.step(model, x, pad)
    r = count_step(model, x, pad, device)
    r.update(arch=arch, shape=list(shape), precision=precision, impl=impl, compiled=compiled,
             generated_at_compile=compiled_count)  # fmt: skip
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["8,50,64,2", "8,200,64,2"], help="B,T,d,H")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    p.add_argument("--on-impls", nargs="+", default=["blockwise", "chunked"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args()
    if args.device == "cpu":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # one profiler event per C++ kernel
    rows = table(args.archs, [tuple(int(v) for v in s.split(",")) for s in args.shapes],
                 args.on_impls, args.device, not args.skip_compile)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def table(archs: list[str], shapes: list[tuple[int, ...]], on_impls: list[str], device: str,
          with_compile: bool = True, out=print) -> list[dict]:  # fmt: skip
    """Print the markdown table (one row per arch, shape, mode) and return the raw rows."""
    rule = (
        "CUDA kernel launches"
        if device == "cuda"
        else "kernels (ATen ops that run one + C++ kernels)"
    )
    out(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}: {rule} "
        "per forward + backward step, one layer")  # fmt: skip
    impls = {a: (["-"] if a == "hstu" else on_impls) for a in archs}
    out("\n| layer | B, T, d, H | mode | off | on (impl) | on/off |")
    out("|---|---|---|---|---|---|")
    rows = []
    for arch in archs:
        for shape in shapes:
            for compiled in (False, True) if with_compile else (False,):
                mode = "compiled" if compiled else "eager"
                off = run_case(arch, shape, "off", "sdpa", compiled, device)
                rows.append(off)
                for impl in impls[arch]:
                    on = run_case(arch, shape, "on", "chunked" if impl == "-" else impl,
                                  compiled, device)  # fmt: skip
                    on["impl"] = impl
                    rows.append(on)
                    ratio = on["kernels"] / max(off["kernels"], 1)
                    extra = ""
                    if "generated" in on and compiled:
                        extra = (f" [C++ {off['generated']} / {on['generated']}, "
                                 f"ATen {off['aten']} / {on['aten']}]")  # fmt: skip
                    out(f"| {arch} | {', '.join(map(str, shape))} | {mode} | {off['kernels']} "
                        f"| {on['kernels']} ({impl}) | {ratio:.2f}{extra} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
