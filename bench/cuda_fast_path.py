"""The fused kriging kernel on a CUDA GPU: correctness, then on/off ratio tables.

One short script for a GPU machine (a few minutes; ``bench/gpu/fast_path.sh`` runs
it there unattended): it prints, and with ``--md`` / ``--json`` writes,

1. the fused Triton kernel against the materialised reference at small shapes
   (float64 and float32, causal and not, padding, dropout against the blockwise
   version's identical mask): max differences of values and gradients;
2. one encoder layer, forward + backward, BFT on each of the chunked, blockwise
   and fused kernels against its off twin (PyTorch's SDPA) at T = 50, 200, 1024:
   time and peak-memory ratios, eager and compiled (both twins measured in the
   same call, interleaved);
3. one training step (forward, full-softmax loss, backward, AdamW) of SASRec,
   BERT4Rec and HSTU on synthetic ids, on/off, eager and compiled, with the peak
   memory of the step (HSTU's pointwise attention has no softmax and does not
   use the kernel; it is listed for the step's other costs);
4. the CUDA kernels one layer launches per forward + backward step (encoder
   layer, Llama decoder layer, HSTU block; B, T, d, H = 64, 200, 64, 2), off
   against on (fused), eager and compiled (``bench/kernel_count.py``'s table).

The goals it is read against: a whole-model training step at most 1.2x its off
twin, one layer at most 1.3x.

    python bench/cuda_fast_path.py                 # everything (~3-5 minutes on one GPU)
    python bench/cuda_fast_path.py --skip-compile  # eager only
    python bench/cuda_fast_path.py --only-kernel-count
    python bench/cuda_fast_path.py --device cpu --tiny --skip-compile   # the code path, seconds

On a CPU the fused kernel runs its blockwise version (Triton needs CUDA, or
``TRITON_INTERPRET=1``); the CPU mode checks that the script runs, not speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common.hardware import device_name  # noqa: E402

LAYER_SHAPES = [(256, 50, 64, 2), (64, 200, 64, 2), (8, 1024, 128, 4)]
TINY_LAYER_SHAPES = [(2, 50, 16, 2), (2, 64, 16, 2)]
LAYER_IMPLS = ("fused", "blockwise", "chunked")  # the fused kernel first: a cut-short run has it
STEP = dict(batch=256, max_len=50, items=12_000)
TINY_STEP = dict(batch=4, max_len=12, items=50)


class Report:
    """The markdown lines printed as they come, and the raw rows; both written to their
    files (``--md`` / ``--json``) as they come too, so a run cut short keeps its tables."""

    def __init__(self, md: Path | None = None, json_path: Path | None = None) -> None:
        self.lines: list[str] = []
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.md, self.json = md, json_path
        if md:
            md.write_text("")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.md:
            with self.md.open("a") as f:
                f.write(line + "\n")

    def row(self, table: str, **values: Any) -> None:
        self.rows.setdefault(table, []).append(values)
        if self.json:
            doc = {"versions": self.lines[0][2:], "argv": sys.argv[1:], "tables": self.rows}
            self.json.write_text(json.dumps(doc, indent=1) + "\n")


def _check_device(device: str) -> None:
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        sys.exit("bench/cuda_fast_path.py needs a CUDA GPU: torch.cuda.is_available() is False")
    from bft_lightning.nn.kernels.fused_triton import triton_available

    if not triton_available():
        sys.exit("bench/cuda_fast_path.py needs Triton: pip install 'bft-lightning[triton]'")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def versions(device: str) -> str:
    """The device and the software the figures were measured with."""
    import lightning

    try:
        import triton

        tri = triton.__version__
    except ImportError:
        tri = "absent"
    name = device_name(device) or "CPU"
    return (f"{name}; python {sys.version.split()[0]}, torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, triton {tri}, lightning {lightning.__version__}")  # fmt: skip


def correctness(out: Report, device: str, tiny: bool) -> None:
    from bft_lightning.nn.attention import build_allowed, reference_attention
    from bft_lightning.nn.kernels.blockwise import blockwise_attention
    from bft_lightning.nn.kernels.fused_triton import fused_kriging_attention, uses_triton

    path = "Triton" if uses_triton(torch.zeros(1, device=device)) else "its blockwise version"
    out(f"\n## Fused kernel ({path}) against the reference ({device}), max |difference|\n")
    out("| dtype | B, H, T, d_h | causal | dropout | values | gradients |")
    out("|---|---|---|---|---|---|")
    cases = [
        (torch.float64, (2, 2, 37, 16), False, 0.0),
        (torch.float64, (2, 2, 37, 16), True, 0.0),
        (torch.float32, (4, 2, 200, 32), True, 0.0),
        (torch.float32, (2, 4, 300, 64), False, 0.0),
        (torch.float32, (4, 2, 200, 32), True, 0.1),
    ]
    if tiny:
        cases = [(dt, (1, 2, 19, 8), c, d) for dt, _, c, d in cases[:2] + cases[-1:]]
    for dtype, (b, h, t, dh), causal, drop in cases:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b, h, t, dh, device=device, dtype=dtype, generator=g)
                   for _ in range(3))  # fmt: skip
        bias = torch.randn(b, h, t, device=device, dtype=dtype, generator=g)
        valid = torch.ones(b, t, dtype=torch.bool, device=device)
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
            o, _, st = reference_attention(*ref_leaves[:3], allowed, ref_leaves[3], 0.0, True)
            assert st is not None
            ref = (o, st.estimate, st.second_moment, st.sum_p_sq)
        w = [torch.randn(r.shape, device=device, dtype=torch.float64, generator=g) for r in ref]
        grads = torch.autograd.grad(sum((o * x.to(dtype)).sum() for o, x in zip(got, w)), leaves)
        grads_ref = torch.autograd.grad(sum((o * x).sum() for o, x in zip(ref, w)), ref_leaves)
        dv = max((a.double() - r).abs().max().item() for a, r in zip(got, ref))
        dg = max((a.double() - r).abs().max().item() for a, r in zip(grads, grads_ref))
        name = str(dtype).replace("torch.", "")
        out(f"| {name} | {b}, {h}, {t}, {dh} | {causal} | {drop} | {dv:.2e} | {dg:.2e} |")
        out.row("correctness", dtype=name, shape=[b, h, t, dh], causal=causal, dropout=drop,
                values=dv, gradients=dg)  # fmt: skip


def layer_table(out: Report, impls: list[str], compile_: bool, reps: int, device: str,
                shapes: list[tuple[int, int, int, int]]) -> None:  # fmt: skip
    import layer_overhead as lo

    label = "compiled" if compile_ else "eager"
    out(f"\n## One encoder layer, forward + backward, BFT / off twin (SDPA), {label}\n")
    out("| B, T, d, H | BFT kernel | ms off | ms on | time on/off | MB off | MB on | mem on/off |")
    out("|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        for impl in impls:  # each kernel measured against a fresh off twin, interleaved
            r = lo.measure(shape, reps, "sdpa", impl, 256, device, compile_)
            t_off, t_on = (1e3 * r["time"][n] for n in ("off", "on"))
            m_off, m_on = (r["mem"][n] / 2**20 for n in ("off", "on"))
            out(f"| {', '.join(map(str, shape))} | {impl} | {t_off:.2f} | {t_on:.2f} | "
                f"{t_on / t_off:.2f} | {m_off:.1f} | {m_on:.1f} | "
                f"{m_on / max(m_off, 1e-9):.2f} |")  # fmt: skip
            out.row("layer", shape=list(shape), impl=impl, compiled=compile_, ms_off=t_off,
                    ms_on=t_on, mb_off=m_off, mb_on=m_on)  # fmt: skip


def _step_time(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[float, float]:
    """Median seconds of a training step, and its peak memory in MB (CUDA; NaN on a CPU)."""
    device = ids.device.type
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    targets = torch.randint(1, model.num_items, ids.shape, device=ids.device)
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    for i in range(steps + 3):
        _sync(device)
        start = time.perf_counter()
        hidden = model.encode(ids)[0]  # type: ignore[operator]
        logits = hidden @ model.item_weights().T  # type: ignore[operator]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= 3:  # warm-up (compiled: the graphs are built first)
            times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
    return statistics.median(times), peak


def step_table(out: Report, impl: str, compile_: bool, steps: int, device: str,
               size: dict[str, int]) -> None:  # fmt: skip
    from bft_lightning.models.bert4rec import BERT4Rec
    from bft_lightning.models.hstu import HSTU
    from bft_lightning.models.sasrec import SASRec

    b, t, n = size["batch"], size["max_len"], size["items"]
    label = "compiled" if compile_ else "eager"
    out(f"\n## Training step, {b} sequences of {t} ids, {n} items, on ({impl}) / off ({label})\n")
    out("| backbone | ms off | ms on | on/off | peak MB off | peak MB on | mem on/off |")
    out("|---|---|---|---|---|---|---|")
    ids = torch.randint(1, n, (b, t), device=device)
    ids[: b // 4, : 2 * t // 5] = 0  # left padding
    for name, cls in (("sasrec", SASRec), ("bert4rec", BERT4Rec), ("hstu", HSTU)):
        ms, mb = {}, {}
        for precision in ("off", "on"):
            torch.manual_seed(0)
            kwargs = {} if name == "hstu" else {"attention_impl": impl}
            model = cls(n, t, precision=precision, **kwargs).to(device).train()
            if compile_:
                torch._dynamo.reset()
                model.encode = torch.compile(model.encode)  # type: ignore[method-assign]
            sec, mb[precision] = _step_time(model, ids, steps)
            ms[precision] = 1e3 * sec
            del model
        mem = (f"{mb['off']:.1f} | {mb['on']:.1f} | {mb['on'] / mb['off']:.2f}"
               if device == "cuda" else "- | - | -")  # fmt: skip
        out(f"| {name} | {ms['off']:.2f} | {ms['on']:.2f} | {ms['on'] / ms['off']:.2f} | {mem} |")
        out.row("step", backbone=name, impl=impl, compiled=compile_, ms_off=ms["off"],
                ms_on=ms["on"], mb_off=mb["off"], mb_on=mb["on"])  # fmt: skip


def kernel_count_table(out: Report, impl: str, compile_: bool, device: str, tiny: bool) -> None:
    import kernel_count as kc

    out("\n## Kernels per forward + backward step, one layer, off / on\n")
    shape = (2, 16, 16, 2) if tiny else (64, 200, 64, 2)
    rows = kc.table(list(kc.ARCHS), [shape], [impl], device, compile_, out=out)
    for r in rows:
        out.row("kernel_count", **{k: v for k, v in r.items() if isinstance(v, (int, float, str))})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes and counts (a CPU check)")
    p.add_argument("--reps", type=int, default=10, help="timed layer steps per twin")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per model")
    p.add_argument("--impls", nargs="+", default=list(LAYER_IMPLS), choices=LAYER_IMPLS,
                   help="the BFT kernels of the layer table")  # fmt: skip
    p.add_argument("--step-impl", default="fused", choices=LAYER_IMPLS,
                   help="the BFT kernel of the training-step and kernel-count tables")  # fmt: skip
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"],
                   choices=["eager", "compiled"], help="the timed tables' modes")  # fmt: skip
    p.add_argument("--skip-compile", action="store_true", help="the same as --modes eager")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-kernel-count", action="store_true")
    p.add_argument("--only-kernel-count", action="store_true", help="the kernel-count table only")
    p.add_argument("--md", type=Path, default=None, help="also write the tables to this file")
    p.add_argument("--json", type=Path, default=None, help="also write the raw rows here")
    args = p.parse_args()
    _check_device(args.device)
    if args.tiny:
        args.reps, args.steps = min(args.reps, 2), min(args.steps, 2)
    out = Report(args.md, args.json)
    out(f"# {versions(args.device)}")
    out("\n    python bench/cuda_fast_path.py " + " ".join(sys.argv[1:]))
    modes = [m == "compiled" for m in args.modes if not (args.skip_compile and m == "compiled")]
    if not args.only_kernel_count:
        if not args.skip_correctness:
            correctness(out, args.device, args.tiny)
        for compile_ in modes:
            shapes = TINY_LAYER_SHAPES if args.tiny else LAYER_SHAPES
            layer_table(out, args.impls, compile_, args.reps, args.device, shapes)
            size = TINY_STEP if args.tiny else STEP
            step_table(out, args.step_impl, compile_, args.steps, args.device, size)
    if not args.skip_kernel_count:
        kernel_count_table(out, args.step_impl, True in modes, args.device, args.tiny)


if __name__ == "__main__":
    main()
