"""A checkpoint's encoder as ONNX, and its item table, bias and vocabulary beside it.

The graph maps a left-padded history (``input_ids`` (N, L) int64, 0 =
padding; and ``times`` (N, L) int64 unix seconds for a model that reads them)
to ``user`` (N, d), the transformed state the items are scored against, and
``scale`` (N, 1), the per-user factor (ones without ``head="precision"``).
Any runtime then scores every item as the model does,

    scores = scale * (user @ items.T + bias)      (column 0, padding, never a candidate)

with ``items.npy`` (num_items + 1, d) and ``item_bias.npy`` (num_items + 1,)
written beside ``model.onnx``, the raw ids in ``vocabulary.json`` and how to
call it in ``export.json``.

BFT's custom ops (the fused GELU-Jacobian and LayerNorm-sigma functions, the
blockwise and chunked attention kernels) carry hand-written backwards that no
exporter reads; :func:`export_safe` swaps them for their plain-op forms
(``backward="autograd"``, ``attention_impl="reference"``) while exporting. In
eval those compute the same values (tests compare them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from bft_lightning.models.base import SequentialRecommender
from bft_lightning.nn.kernels import KERNELS

from .recommender import Recommender

__all__ = ["ExportError", "UserVector", "export", "export_safe", "onnx_topk"]

FILES = ("model.onnx", "items.npy", "item_bias.npy", "vocabulary.json", "export.json")
PLAIN_IMPLS = ("reference", "sdpa")
OPSET = 17


class ExportError(ValueError):
    """A backbone that cannot be exported; the message says which and why."""


@contextmanager
def export_safe(model: nn.Module) -> Iterator[None]:
    """Run a block with every custom op of ``model`` replaced by plain torch ops: each
    layer's ``backward="custom"`` becomes ``"autograd"`` and each attention kernel
    other than ``reference``/``sdpa`` (``auto`` included) becomes ``reference``;
    restored afterwards."""
    saved: list[tuple[nn.Module, str, Any]] = []
    for module in model.modules():
        if getattr(module, "backward", None) == "custom":
            saved.append((module, "backward", "custom"))
            setattr(module, "backward", "autograd")  # noqa: B010 (a str attribute; mypy)
        impl = getattr(module, "impl", None)
        # "auto" resolves to a custom-op kernel in eager mode (nn.kernels.resolve)
        if (
            isinstance(impl, str)
            and (impl in KERNELS or impl == "auto")
            and impl not in PLAIN_IMPLS
        ):
            saved.append((module, "impl", impl))
            setattr(module, "impl", "reference")  # noqa: B010
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class UserVector(nn.Module):
    """``(input_ids[, times]) -> (user, scale)``: what the exported graph computes."""

    def __init__(self, model: SequentialRecommender, with_times: bool) -> None:
        super().__init__()
        self.model, self.with_times = model, with_times

    def forward(self, input_ids: Tensor, times: Tensor | None = None) -> tuple[Tensor, Tensor]:
        model = self.model
        hidden, log_prec = model.last_hidden(input_ids, times if self.with_times else None)
        weights = model.item_weights()
        user = model.output_transform(hidden.to(weights.dtype))
        scale = model.output_scale(log_prec)
        if scale is None:
            scale = torch.ones_like(user[:, :1])
        return user, scale.to(user.dtype)


def _logaddexp(g: Any, a: Any, b: Any) -> Any:
    """ONNX for ``aten::logaddexp`` (the filter's precision sums; no opset has it):
    ``max(a, b) + log(1 + exp(-|a - b|))``, finite inputs (the log precisions are clamped)."""
    top = g.op("Max", a, b)
    gap = g.op("Neg", g.op("Abs", g.op("Sub", a, b)))
    one = g.op("Constant", value_t=torch.tensor(1.0))
    return g.op("Add", top, g.op("Log", g.op("Add", one, g.op("Exp", gap))))


def _ndtr(g: Any, x: Any) -> Any:
    """ONNX for ``aten::special_ndtr``, the standard normal CDF: ``(1 + erf(x / sqrt 2)) / 2``."""
    half = g.op("Constant", value_t=torch.tensor(0.5))
    root = g.op("Constant", value_t=torch.tensor(2.0**-0.5))
    one = g.op("Constant", value_t=torch.tensor(1.0))
    return g.op("Mul", half, g.op("Add", one, g.op("Erf", g.op("Mul", x, root))))


def _register_symbolics() -> None:
    """Ops the TorchScript exporter has no ONNX form for, written with ONNX ops."""
    torch.onnx.register_custom_op_symbolic("aten::logaddexp", _logaddexp, OPSET)
    torch.onnx.register_custom_op_symbolic("aten::special_ndtr", _ndtr, OPSET)


def _example(
    rec: Recommender, with_times: bool, batch: int = 2, width: int = 5
) -> tuple[Tensor, ...]:
    width = max(1, min(rec.max_len, width))
    generator = torch.Generator().manual_seed(batch * 1000 + width)
    ids = torch.randint(1, rec.num_items + 1, (batch, width), generator=generator)
    ids[-1, : width // 2] = 0  # padding in the example: the graph must not specialise on it
    if not with_times:
        return (ids,)
    times = torch.arange(width).expand(batch, -1) * 3600 + 1_400_000_000
    return ids, times.masked_fill(ids == 0, 0)


def _onnx_export(
    wrapper: nn.Module, example: tuple, path: Path, names: list, dims: dict, dynamo: bool
) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on shape-dependent Python values
        torch.onnx.export(
            wrapper, example, str(path), input_names=names, output_names=["user", "scale"],
            dynamic_axes=dims, dynamo=dynamo, opset_version=OPSET if not dynamo else 18,
        )  # fmt: skip


def _verify(wrapper: nn.Module, path: Path, rec: Recommender, with_times: bool) -> str | None:
    """None when onnxruntime gives PyTorch's outputs (within 1e-4) on the export example
    and on another batch size and width; else what differs. Skipped without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for batch, width in ((2, max(2, min(rec.max_len, 5))), (3, max(1, min(rec.max_len, 3)))):
            example = _example(rec, with_times, batch, width)
            feeds = {n: t.numpy() for n, t in zip(("input_ids", "times"), example)}
            got = session.run(["user", "scale"], feeds)
            with torch.no_grad():
                want = wrapper(*example)
            for g, w in zip(got, want):
                if g.shape != tuple(w.shape) or not np.allclose(g, w.numpy(), atol=1e-4, rtol=0):
                    return f"onnxruntime differs from PyTorch (batch {batch}, width {width})"
    except Exception as err:
        return "onnxruntime: " + (str(err).strip().splitlines() or [type(err).__name__])[0]
    return None


def output_files(output: str | Path, checkpoint: str | Path, overwrite: bool = False) -> list[Path]:
    """The files ``export`` writes into the folder ``output``, each through the one output
    guard (``utils.outputs``): never the checkpoint, an existing file only with
    ``overwrite``; a missing folder is made, in an existing, writable parent."""
    from bft_lightning.utils.outputs import OutputPathError, check_output, same_file

    out = Path(output)
    if not out.exists():
        check_output(out, [checkpoint], False, "--output")  # its parent: there, writable
        for name in FILES:
            if same_file(out / name, checkpoint):
                raise OutputPathError(
                    f"--output {out / name}: is one of the command's inputs ({checkpoint}); "
                    "it is never overwritten: write the output to another folder"
                )
        return [out / name for name in FILES]
    if not out.is_dir():
        raise OutputPathError(f"--output {output}: exists and is not a folder")
    for name in FILES:
        check_output(out / name, [checkpoint], overwrite, "--output")
    return [out / name for name in FILES]


def export(
    rec: Recommender, checkpoint: str | Path, output: str | Path, overwrite: bool = False
) -> Path:
    """Write the ONNX graph and the files beside it into the folder ``output``.

    Raises ``ExportError`` (one line: the backbone and the reason) when the graph
    cannot be exported, ``ValueError`` when a file would replace the checkpoint or an
    existing file without ``overwrite``.
    """
    out = Path(output)
    paths = output_files(out, checkpoint, overwrite)
    model = rec.model.eval()
    with_times = rec.uses_times
    wrapper = UserVector(model, with_times).eval()
    example = _example(rec, with_times)
    names = ["input_ids", "times"][: len(example)]
    dims = {name: {0: "batch", 1: "length"} for name in names}
    out.mkdir(parents=True, exist_ok=True)
    label = f"{type(model).__name__} (precision={model.precision})"
    _register_symbolics()
    failures = []
    for dynamo in (False, True):  # TorchScript first (seconds); the dynamo exporter if it fails
        try:
            with export_safe(model), torch.no_grad():
                _onnx_export(wrapper, example, paths[0], names, dims, dynamo)
            problem = _verify(wrapper, paths[0], rec, with_times)
        except Exception as err:  # any exporter failure: name the backbone and the reason
            problem = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if problem is None:
            break
        failures.append(f"{'dynamo' if dynamo else 'TorchScript'} exporter: {problem}")
    else:
        raise ExportError(f"{label} cannot be exported to ONNX: {'; '.join(failures)}")
    with torch.no_grad():
        items = model.item_weights().detach().float().cpu().numpy()
        bias = model.item_bias()
        b = np.zeros(items.shape[0], np.float32) if bias is None else bias.detach().float().numpy()
    np.save(paths[1], items)
    np.save(paths[2], b.astype(np.float32))
    paths[3].write_text(json.dumps({"item_ids": [str(i) for i in rec.item_ids]}))
    meta = {
        "model": type(model).__name__, "precision": model.precision,
        "num_items": rec.num_items, "max_len": rec.max_len,
        "inputs": {"input_ids": "(N, L) int64, left-padded with 0, L <= max_len"}
        | ({"times": "(N, L) int64 unix seconds, 0 at padding"} if with_times else {}),
        "outputs": {"user": "(N, d) float32", "scale": "(N, 1) float32"},
        "scores": "scale * (user @ items.T + item_bias); column 0 is padding",
        "needs_times": rec.needs_times, "checkpoint": str(checkpoint),
        "data_fingerprint": rec.fingerprint,
    }  # fmt: skip
    paths[4].write_text(json.dumps(meta, indent=1))
    return out


def onnx_topk(
    folder: str | Path, input_ids: np.ndarray, k: int, times: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (scores, item indices) of each history under onnxruntime, from an
    exported folder: what any runtime does with the files."""
    import onnxruntime as ort

    folder = Path(folder)
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": input_ids.astype(np.int64)}
    if times is not None and len(session.get_inputs()) > 1:
        feeds["times"] = times.astype(np.int64)
    user, scale = session.run(["user", "scale"], feeds)
    items = np.load(folder / "items.npy")
    bias = np.load(folder / "item_bias.npy")
    scores = (user @ items.T + bias) * scale
    scores[:, 0] = -np.inf
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, top, 1), top
