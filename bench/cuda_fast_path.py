"""The fused kriging kernel on a CUDA GPU: correctness, then on/off ratio tables.

One short script for a GPU machine (a few minutes): it prints

1. the fused Triton kernel against the materialised reference at small shapes
   (float64 and float32, causal and not, padding, dropout against the blockwise
   version's identical mask): max differences of values and gradients;
2. one encoder layer, forward + backward, BFT on the fused path against its
   off twin (PyTorch's SDPA): time and peak-memory ratios, eager and compiled;
3. one training step (forward, full-softmax loss, backward, AdamW) of SASRec,
   BERT4Rec and HSTU on synthetic ids, on/off, eager and compiled (HSTU's
   pointwise attention has no softmax and does not use the kernel; it is listed
   for the step's other costs);
4. the CUDA kernels one layer launches per forward + backward step (encoder
   layer, Llama decoder layer, HSTU block; B, T, d, H = 64, 200, 64, 2), off
   against on (fused), eager and compiled (``bench/kernel_count.py``'s table).

The BFT layers reach the kernel through ``attention_impl="fused"`` once the
dispatch offers it; until then this script routes the layers' chunked path to
the fused kernel (same arguments and returns) for its own runs only.

    python bench/cuda_fast_path.py                 # everything (~3-5 minutes on one GPU)
    python bench/cuda_fast_path.py --skip-compile  # eager only
    python bench/cuda_fast_path.py --only-kernel-count
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LAYER_SHAPES = [(256, 50, 64, 2), (64, 200, 64, 2), (8, 1024, 128, 4), (2, 4096, 256, 4)]


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/cuda_fast_path.py needs a CUDA GPU: torch.cuda.is_available() is False")
    from bft_lightning.nn.kernels.fused_triton import triton_available

    if not triton_available():
        sys.exit("bench/cuda_fast_path.py needs Triton: pip install 'bft-lightning[triton]'")


def _fused_impl() -> str:
    """``"fused"`` where the layers accept it, else route ``"chunked"`` to the kernel."""
    from bft_lightning.nn import attention

    if "fused" in getattr(attention, "ATTENTION_IMPLS", ()):
        return "fused"
    from bft_lightning.nn.kernels.fused_triton import fused_kriging_attention

    def chunked_as_fused(q, k, v, allowed, bias, dropout_p, chunk_size=256, keep_weights=None):  # type: ignore[no-untyped-def]
        return fused_kriging_attention(q, k, v, allowed, bias, dropout_p)

    attention.chunked_attention = chunked_as_fused  # type: ignore[assignment]
    print("(attention_impl='fused' not offered yet: the chunked path runs the fused kernel)")
    return "chunked"


def correctness() -> None:
    from bft_lightning.nn.attention import build_allowed, reference_attention
    from bft_lightning.nn.kernels.blockwise import blockwise_attention
    from bft_lightning.nn.kernels.fused_triton import fused_kriging_attention

    print("\n## Fused kernel against the reference (CUDA), max |difference|\n")
    print("| dtype | B, H, T, d_h | causal | dropout | values | gradients |")
    print("|---|---|---|---|---|---|")
    for dtype, (b, h, t, dh), causal, drop in [
        (torch.float64, (2, 2, 37, 16), False, 0.0),
        (torch.float64, (2, 2, 37, 16), True, 0.0),
        (torch.float32, (4, 2, 200, 32), True, 0.0),
        (torch.float32, (2, 4, 300, 64), False, 0.0),
        (torch.float32, (4, 2, 200, 32), True, 0.1),
    ]:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, t, dh, device="cuda", dtype=dtype, generator=g)
                   for _ in range(3))  # fmt: skip
        bias = torch.randn(b, h, t, device="cuda", dtype=dtype, generator=g)
        valid = torch.ones(b, t, dtype=torch.bool, device="cuda")
        valid[0, : t // 3] = False
        allowed = build_allowed(valid, causal)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        ref_leaves = [x.clone().double().requires_grad_() for x in (q, k, v, bias)]
        torch.manual_seed(1)
        got = fused_kriging_attention(*leaves[:3], allowed, leaves[3], drop)
        if drop > 0:  # the blockwise version draws the same mask from the same seed
            torch.manual_seed(1)
            ref = blockwise_attention(*ref_leaves[:3], allowed, ref_leaves[3], drop)
        else:
            out, _, st = reference_attention(*ref_leaves[:3], allowed, ref_leaves[3], 0.0, True)
            assert st is not None
            ref = (out, st.estimate, st.second_moment, st.sum_p_sq)
        w = [torch.randn(r.shape, device="cuda", dtype=torch.float64, generator=g) for r in ref]
        grads = torch.autograd.grad(sum((o * x.to(dtype)).sum() for o, x in zip(got, w)), leaves)
        grads_ref = torch.autograd.grad(sum((o * x).sum() for o, x in zip(ref, w)), ref_leaves)
        dv = max((a.double() - r).abs().max().item() for a, r in zip(got, ref))
        dg = max((a.double() - r).abs().max().item() for a, r in zip(grads, grads_ref))
        name = str(dtype).replace("torch.", "")
        print(f"| {name} | {b}, {h}, {t}, {dh} | {causal} | {drop} | {dv:.2e} | {dg:.2e} |")


def layer_table(impl: str, compile_: bool, reps: int) -> None:
    import layer_overhead as lo

    label = "compiled" if compile_ else "eager"
    print(f"\n## One encoder layer, forward + backward, fused BFT / off twin ({label})\n")
    print("| B, T, d, H | ms off | ms on | time on/off | MB off | MB on | mem on/off |")
    print("|---|---|---|---|---|---|---|")
    for shape in LAYER_SHAPES:
        r = lo.measure(shape, reps, "sdpa", impl, 256, "cuda", compile_)
        t_off, t_on = (1e3 * r["time"][n] for n in ("off", "on"))
        m_off, m_on = (r["mem"][n] / 2**20 for n in ("off", "on"))
        row = f"| {', '.join(map(str, shape))} | {t_off:.2f} | {t_on:.2f} | {t_on / t_off:.2f} "
        print(row + f"| {m_off:.1f} | {m_on:.1f} | {m_on / max(m_off, 1e-9):.2f} |", flush=True)


def _step_time(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    targets = torch.randint(1, model.num_items, ids.shape, device=ids.device)
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        hidden = model.encode(ids)[0]  # type: ignore[operator]
        logits = hidden @ model.item_weights().T  # type: ignore[operator]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 3:  # warm-up (compiled: the graphs are built first)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_table(impl: str, compile_: bool, steps: int) -> None:
    from bft_lightning.models.bert4rec import BERT4Rec
    from bft_lightning.models.hstu import HSTU
    from bft_lightning.models.sasrec import SASRec

    label = "compiled" if compile_ else "eager"
    print(f"\n## Training step, 256 sequences of 50 ids, 12k items, on / off ({label})\n")
    print("| backbone | ms off | ms on | on/off |")
    print("|---|---|---|---|")
    ids = torch.randint(1, 12_000, (256, 50), device="cuda")
    ids[:64, :20] = 0  # left padding
    for name, cls in (("sasrec", SASRec), ("bert4rec", BERT4Rec), ("hstu", HSTU)):
        ms = {}
        for precision in ("off", "on"):
            torch.manual_seed(0)
            kwargs = {} if name == "hstu" else {"attention_impl": impl}
            model = cls(12_000, 50, precision=precision, **kwargs).cuda().train()
            if compile_:
                torch._dynamo.reset()
                model.encode = torch.compile(model.encode)  # type: ignore[method-assign]
            ms[precision] = 1e3 * _step_time(model, ids, steps)
        print(f"| {name} | {ms['off']:.2f} | {ms['on']:.2f} | {ms['on'] / ms['off']:.2f} |",
              flush=True)  # fmt: skip


def kernel_count_table(impl: str, compile_: bool) -> None:
    import kernel_count as kc

    print("\n## CUDA kernels per forward + backward step, one layer, off / on\n")
    kc.table(list(kc.ARCHS), [(64, 200, 64, 2)], [impl], "cuda", compile_)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10, help="timed layer steps per twin")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per model")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--only-kernel-count", action="store_true", help="the kernel-count table only")
    args = p.parse_args()
    _require_cuda()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    impl = _fused_impl()
    if not args.only_kernel_count:
        correctness()
        for compile_ in (False,) if args.skip_compile else (False, True):
            layer_table(impl, compile_, args.reps)
            step_table(impl, compile_, args.steps)
    kernel_count_table(impl, not args.skip_compile)


if __name__ == "__main__":
    main()
