"""Fixtures of the language-model tests (single-threaded; tiny models only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lm_helpers import write_hf_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
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
