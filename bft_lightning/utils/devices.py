"""A device name checked before anything is loaded onto it.

``torch.device("cuda")`` is accepted on a machine without CUDA; the failure
comes later, deep inside the first ``.to()``, as a ``RuntimeError`` or an
``AssertionError`` ("Torch not compiled with CUDA enabled"). The command line
(``--device``) and the API (``device=``) check the name first and say what
is available, in one line naming the option.
"""

from __future__ import annotations

import torch

__all__ = ["check_device"]


def check_device(device: object, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` that exists here; else ``ValueError`` naming ``what``."""
    if isinstance(device, torch.device):
        parsed = device
    elif isinstance(device, str):
        try:
            parsed = torch.device(device)
        except (RuntimeError, ValueError) as err:
            raise ValueError(
                f"{what}: {device!r} is not a device name (cpu, cuda, cuda:1, mps): "
                f"{str(err).splitlines()[0]}"
            ) from None
    else:
        raise ValueError(f"{what}: expected a device name such as 'cpu' or 'cuda', got {device!r}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{what}: {device!s} asked for, but CUDA is not available on this machine (use cpu)"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(
                f"{what}: {device!s} asked for, but this machine has {count} CUDA device(s)"
            )
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{what}: mps asked for, but MPS is not available on this machine")
    elif parsed.type not in ("cpu", "cuda", "mps", "meta"):
        raise ValueError(f"{what}: device type {parsed.type!r} is not supported here (use cpu)")
    return parsed
