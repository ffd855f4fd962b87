"""Fixtures of the language-model tests (tiny models only), imported by ``tests/conftest.py``.

A module that wants one thread says so: ``pytestmark = pytest.mark.usefixtures("one_thread")``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lm_helpers import write_hf_checkpoint


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def hf_model(hf_checkpoint: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(hf_checkpoint, dtype=torch.float32).eval()
