"""On/off ratios on a CPU: one encoder layer and whole training steps, eager and compiled.

``layers``: one ``BFTEncoderLayer`` (d = 64 / 64 / 256, H = 2 / 2 / 4 at
T = 50 / 200 / 1024; causal), forward + ``y.square().mean()`` + backward,
either with a left-padding mask and attention / FFN dropout 0.1 (``--case
masked``) or with the causal mask only and no dropout (``--case plain``).
Every variant is built from the same weights and timed in interleaved
repetitions (the order rotates from one repetition to the next), medians:

- off twin: ``sdpa`` (PyTorch's ``scaled_dot_product_attention``) and
  ``math`` (the materialised reference path, ``attention_impl="reference"``);
  the ratio is taken against the faster of the two (its best kernel);
- BFT: ``blockwise`` (the kernel that compiles without a graph break) and,
  eager only, ``chunked`` (the eager CPU default; its hand-written backward
  would run outside a compiled graph).

Memory on a CPU is the bytes of the distinct storages saved for backward
(``layer_overhead.peak_memory``; PyTorch keeps no CPU allocator statistics),
not a transient peak. Compiled: ``torch.compile`` (inductor, static shapes),
the warm-up calls build the graphs before timing.

``steps``: one training step (``encode``, full-softmax cross entropy over the
catalogue, backward, AdamW) of SASRec, BERT4Rec and HSTU, off against on, on
``--batch`` sequences of 50 ids over ``--items`` items (a quarter of the rows
left-padded), dropout 0.2 (the models' default). Eager: on with ``chunked``
and ``blockwise``; compiled (``encode`` under ``torch.compile(dynamic=True)``,
as the task's ``compile: true``): on with ``blockwise``.

    OMP_WAIT_POLICY=PASSIVE python bench/fast_path_cpu.py layers --threads 2 --case plain
    OMP_WAIT_POLICY=PASSIVE python bench/fast_path_cpu.py layers --threads 2 --case masked --compile
    OMP_WAIT_POLICY=PASSIVE python bench/fast_path_cpu.py steps --threads 2 --compile

Each call prints its markdown rows and, with ``--json FILE``, appends them there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import layer_overhead as lo  # noqa: E402

SHAPES = {50: (128, 50, 64, 2), 200: (64, 200, 64, 2), 1024: (8, 1024, 256, 4)}
OFF = {"sdpa": "sdpa", "math": "reference"}


def layer_rows(t: int, case: str, compile_: bool, reps: int) -> dict:
    b, _, d, h = SHAPES[t]
    drop = 0.1 if case == "masked" else 0.0
    variants = {f"off-{n}": ("off", impl) for n, impl in OFF.items()}
    variants["on-blockwise"] = ("on", "blockwise")
    if not compile_:
        variants["on-chunked"] = ("on", "chunked")
    torch.manual_seed(0)
    models = {}
    for name, (precision, impl) in variants.items():
        models[name] = lo.build(d, h, precision, impl, "cpu", dropout=drop)
    state = models["off-sdpa"].state_dict()
    for m in models.values():
        m.load_state_dict(state, strict=False)
    if compile_:
        torch._dynamo.reset()
        models = {n: torch.compile(m, dynamic=False) for n, m in models.items()}  # type: ignore[misc]
    x = torch.randn(b, t, d)
    pad = None
    if case == "masked":
        lengths = torch.randint(t // 4, t + 1, (b,), generator=torch.Generator().manual_seed(1))
        pad = torch.arange(t).unsqueeze(0) >= lengths.unsqueeze(1)
    for m in models.values():
        for _ in range(3 if compile_ else 1):
            lo.step(m, x, pad)
    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            models[n].zero_grad(set_to_none=True)
            times[n].append(lo.timed(models[n], x, pad, "cpu"))
    med = {n: statistics.median(v) for n, v in times.items()}
    mem = {n: lo.peak_memory(m, x, pad, "cpu") for n, m in models.items()}
    return {
        "t": t, "shape": SHAPES[t], "case": case, "compiled": compile_, "reps": reps,
        "ms": {n: 1e3 * v for n, v in med.items()},
        "saved_mb": {n: v / 2**20 for n, v in mem.items()},
    }  # fmt: skip


def print_layer(r: dict) -> None:
    ms, mb = r["ms"], r["saved_mb"]
    best_off = min(("off-sdpa", "off-math"), key=lambda n: ms[n])
    mode = "compiled" if r["compiled"] else "eager"
    for on in (n for n in ms if n.startswith("on-")):
        print(f"| {r['t']} | {r['case']} | {mode} | {ms['off-sdpa']:.1f} | {ms['off-math']:.1f} "
              f"| {best_off[4:]} | {on[3:]} | {ms[on]:.1f} | **{ms[on] / ms[best_off]:.2f}** "
              f"| {mb[best_off]:.1f} | {mb[on]:.1f} | {mb[on] / max(mb[best_off], 1e-9):.2f} |",
              flush=True)  # fmt: skip


def step_time(model: torch.nn.Module, ids: torch.Tensor, steps: int, warmup: int) -> list[float]:
    if not hasattr(model, "_bench_opt"):
        model._bench_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # type: ignore[assignment]
    opt = model._bench_opt
    targets = torch.randint(
        1, model.num_items, ids.shape, generator=torch.Generator().manual_seed(2)
    )
    times = []
    for i in range(steps + warmup):
        start = time.perf_counter()
        hidden = model.encode(ids)[0]  # type: ignore[operator]
        logits = hidden @ model.item_weights().T  # type: ignore[operator]
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:  # warm-up (compiled: the graphs are built first)
            times.append(time.perf_counter() - start)
    return times


def step_rows(
    compile_: bool, steps: int, batch: int, items: int, backbones: list[str]
) -> list[dict]:
    from bft_lightning.models import HSTU, BERT4Rec, SASRec

    classes = {"sasrec": SASRec, "bert4rec": BERT4Rec, "hstu": HSTU}
    ids = torch.randint(1, items, (batch, 50), generator=torch.Generator().manual_seed(1))
    ids[: batch // 4, :20] = 0  # left padding
    rows = []
    for name in backbones:
        variants = {"off": ("off", "chunked")}
        impls = ["blockwise"] if compile_ or name == "hstu" else ["chunked", "blockwise"]
        for impl in impls:
            variants[f"on-{impl}"] = ("on", impl)
        models = {}
        for v, (precision, impl) in variants.items():
            torch.manual_seed(0)
            model = classes[name](items, 50, precision=precision, attention_impl=impl).train()
            if compile_:
                model.encode = torch.compile(model.encode, dynamic=True)  # type: ignore[method-assign]
            models[v] = model
        # interleaved: rounds of a few steps of each variant, the order rotating
        times: dict[str, list[float]] = {v: [] for v in models}
        names = list(models)
        for r in range(3):
            for v in names[r % len(names) :] + names[: r % len(names)]:
                times[v] += step_time(models[v], ids, steps, 3 if r == 0 else 0)
        ms = {v: 1e3 * statistics.median(t) for v, t in times.items()}
        row = {"backbone": name, "compiled": compile_, "ms": ms, "batch": batch, "items": items}
        rows.append(row)
        mode = "compiled" if compile_ else "eager"
        for v in (n for n in ms if n != "off"):
            hstu = " (own attention)" if name == "hstu" else ""
            print(f"| {name} | {mode} | {ms['off']:.1f} | {v[3:]}{hstu} | {ms[v]:.1f} "
                  f"| **{ms[v] / ms['off']:.2f}** |", flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["layers", "steps"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--case", choices=["plain", "masked"], default="plain")
    p.add_argument("--ts", type=int, nargs="+", default=[50, 200, 1024], choices=sorted(SHAPES))
    p.add_argument("--compile", action="store_true")
    p.add_argument("--reps", type=int, default=None, help="layers: timed steps per variant")
    p.add_argument("--steps", type=int, default=3, help="steps: timed steps per round (3 rounds)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--items", type=int, default=12_000)
    p.add_argument("--backbones", nargs="+", default=["sasrec", "bert4rec", "hstu"])
    p.add_argument("--json", default=None, help="append the rows to this JSON file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} compile={args.compile}")
    rows: list[dict] = []
    if args.what == "layers":
        print("| T | case | mode | ms off sdpa | ms off math | best off | on | ms on "
              "| time on/best off | MB off | MB on | mem on/off |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for t in args.ts:
            reps = args.reps or {50: 15, 200: 9, 1024: 3}[t]
            rows.append(layer_rows(t, args.case, args.compile, reps))
            print_layer(rows[-1])
    else:
        print("| backbone | mode | ms off | on | ms on | on/off |")
        print("|---|---|---|---|---|---|")
        rows = step_rows(args.compile, args.steps, args.batch, args.items, args.backbones)
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(old + rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
