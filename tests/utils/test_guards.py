"""The small guards other commands call: output paths, devices, argument types."""

from __future__ import annotations

import os

import pytest
import torch

from bft_lightning.utils.checks import check_bool, check_int
from bft_lightning.utils.devices import check_device
from bft_lightning.utils.outputs import OutputPathError, check_output, same_file


def test_check_output_allows_a_new_file_and_replaces_only_when_told(tmp_path):
    target = tmp_path / "out.csv"
    assert check_output(target) is False  # nothing to replace
    target.write_text("x")
    with pytest.raises(OutputPathError, match="the file exists; pass --overwrite"):
        check_output(target)
    assert check_output(target, overwrite=True) is True
    assert target.read_text() == "x"  # the guard never writes


def test_check_output_never_allows_an_input_through_any_link(tmp_path):
    src = tmp_path / "data.csv"
    src.write_text("1,2\n")
    (tmp_path / "soft.csv").symlink_to(src)
    os.link(src, tmp_path / "hard.csv")
    for path in (src, tmp_path / "soft.csv", tmp_path / "hard.csv", tmp_path / "." / "data.csv"):
        with pytest.raises(OutputPathError, match="is one of the command's inputs"):
            check_output(path, [src], overwrite=True, what="--export.output")
    assert same_file(tmp_path / "hard.csv", src) and not same_file(tmp_path / "new", src)


def test_check_output_names_the_option(tmp_path):
    with pytest.raises(OutputPathError, match=r"^--tune\.output .*: is a directory"):
        check_output(tmp_path, what="--tune.output")


def test_check_device_cpu_and_types():
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device: expected a device name"):
        check_device(0)
    with pytest.raises(ValueError, match="'nope' is not a device name"):
        check_device("nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_check_device_on_a_cuda_machine():
    assert check_device("cuda").type == "cuda"
    with pytest.raises(ValueError, match=r"this machine has \d+ CUDA device"):
        check_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_check_device_without_cuda():
    with pytest.raises(ValueError, match="--device: cuda:1 asked for, but CUDA is not available"):
        check_device("cuda:1", "--device")


def test_check_bool_and_int():
    assert check_bool(True, "x") is True
    for bad in ("no", 1, None):
        with pytest.raises(ValueError, match="x must be True or False"):
            check_bool(bad, "x")
    assert check_int(3, "k", 1, 5) == 3
    for bad in (0, 6, 3.0, "3", True):
        with pytest.raises(ValueError, match=r"k must be an integer in 1\.\.5"):
            check_int(bad, "k", 1, 5)
