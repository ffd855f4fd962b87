"""The running sill's policy under gradient checkpointing: 'at once' against 'staged'.

Two BFT layers (encoder, then HSTU), two training steps, a sill started at 0.05,
with and without ``torch.utils.checkpoint`` (``use_reentrant=False``). "at once"
replays the policy the encoder and HSTU had before ``nn/filter.py`` (the buffer
replaced during the forward, every call); "staged" is the library's policy
(``docs/spec.md``, The sill). Prints the table the spec quotes.

    python bench/sill_policy.py > results/sill_policy.txt
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from bft_lightning.nn import BFTEncoderLayer, HSTULayer
from bft_lightning.nn import functional as BF
from bft_lightning.nn.filter import FilterLayer

STAGED = FilterLayer.stage_sill
UPDATES: list[int] = []


def _stage(self: FilterLayer, values: torch.Tensor, valid: torch.Tensor, at_once: bool) -> None:
    if at_once:  # the old encoder / HSTU policy
        UPDATES.append(1)
        new = self.sill.clone()
        BF.update_running_sill_(new, values, valid, self.sill_momentum)
        self.sill = new
    else:
        UPDATES.append(int(self._pending_sill is None))
        STAGED(self, values, valid)


def run(make, ckpt: bool, at_once: bool, kw: dict):
    FilterLayer.stage_sill = lambda self, v, m: _stage(self, v, m, at_once)  # type: ignore[method-assign]
    torch.manual_seed(1)
    layers = torch.nn.ModuleList([make() for _ in range(2)]).train()
    for layer in layers:
        with torch.no_grad():
            layer.sill.fill_(0.05)
    x = torch.randn(3, 7, 16, requires_grad=True)
    UPDATES.clear()
    grads: tuple = ()
    for _ in range(2):
        for layer in layers:
            layer.flush_sill()
        h, lp = x, None
        for layer in layers:
            call = (
                (lambda *a, layer=layer: checkpoint(layer, *a, use_reentrant=False, **kw))
                if ckpt
                else (lambda *a, layer=layer: layer(*a, **kw))
            )
            h, lp = call(h, lp)
        loss = h.square().mean() + lp.exp().mean() * 1e-3
        grads = torch.autograd.grad(loss, [x, *layers.parameters()], allow_unused=True)
    for layer in layers:
        layer.flush_sill()
    return grads, torch.stack([layer.sill for layer in layers]), sum(UPDATES)


def main() -> None:
    blocks = [
        ("encoder", lambda: BFTEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu"),
         {"is_causal": True}),
        ("hstu", lambda: HSTULayer(16, 2, max_len=8), {}),
    ]  # fmt: skip
    for name, make, kw in blocks:
        ga, sa, _ = run(make, False, True, kw)
        gb, sb, _ = run(make, False, False, kw)
        same = max((a - b).abs().max().item() for a, b in zip(ga, gb) if a is not None)
        print(f"{name:8s} no checkpointing, at once vs staged: max grad diff {same:.1e}, "
              f"sill diff {(sa - sb).abs().max().item():.1e}")  # fmt: skip
        for at_once in (True, False):
            g0, s0, c0 = run(make, False, at_once, kw)
            g1, s1, c1 = run(make, True, at_once, kw)
            rel = max(
                (a - b).abs().max().item() / (a.abs().max().item() + 1e-30)
                for a, b in zip(g0, g1)
                if a is not None
            )
            policy = "at once" if at_once else "staged"
            print(f"{name:8s} {policy:8s}: max rel grad diff checkpointed vs not {rel:.2e}, "
                  f"sill diff {(s0 - s1).abs().max().item():.2e}, sill updates {c0} plain / "
                  f"{c1} checkpointed (2 steps x 2 layers)")  # fmt: skip
    FilterLayer.stage_sill = STAGED  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
