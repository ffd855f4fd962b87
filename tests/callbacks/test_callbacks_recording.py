"""Layer selection by name / index and recording shared between callbacks."""

import pytest
import torch
from torch import nn

from bft_lightning.callbacks.recording import acquire, read_stats, release, select_layers
from bft_lightning.nn import BFTEncoder, BFTEncoderLayer


class UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = BFTEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
        self.encoder = BFTEncoder(layer, 3)
        self.other = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def test_select_by_glob_and_by_index():
    m = UserModel()
    names = [n for n, _ in select_layers(m, None, "t")]
    assert names == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    assert [n for n, _ in select_layers(m, ["*.1"], "t")] == ["encoder.layers.1"]
    assert [n for n, _ in select_layers(m, [0, "-1"], "t")] == [names[0], names[2]]


def test_out_of_range_indices_are_refused():
    m = UserModel()  # 3 layers: indices -3..2
    assert [n for n, _ in select_layers(m, [-3], "t")] == ["encoder.layers.0"]
    for index in (3, -4, "3", "-4"):
        with pytest.raises(ValueError, match=rf"t: layers index '?{index}'? .* 3 BFT layers"):
            select_layers(m, [index], "t")
    with pytest.warns(UserWarning, match="found no BFT layer"):  # no layers yet: no range
        assert select_layers(nn.Linear(2, 2), [5], "t") == []


def test_no_match_warns():
    with pytest.warns(UserWarning, match="found no BFT layer"):
        assert select_layers(nn.Linear(2, 2), None, "t") == []


def test_recording_stays_on_until_the_last_owner_releases():
    m = UserModel()
    layers = select_layers(m, None, "t")
    a, b = object(), object()
    acquire(layers, a)
    acquire(layers, b, attention=True)
    m(torch.randn(2, 5, 16))
    assert all(s is not None and s.attention is not None for s in read_stats(layers))
    release(layers, b)
    layer = layers[0][1]
    assert layer.record and not layer.record_attention
    assert layer.last_stats is not None  # a's statistics survive b's release
    release(layers, a)
    assert not layer.record and layer.last_stats is None
    m(torch.randn(2, 5, 16))
    assert read_stats(layers) == [None, None, None]


def test_a_users_own_recording_survives_the_callbacks():
    m = UserModel()
    layers = select_layers(m, None, "t")
    layers[0][1].record = True  # the user records layer 0 for their own analysis
    owner = object()
    acquire(layers, owner, attention=True)
    m(torch.randn(2, 5, 16))
    release(layers, owner)
    release(layers, owner)  # a second release (e.g. on an exception) changes nothing
    first, second = layers[0][1], layers[1][1]
    assert first.record and not first.record_attention and first.last_stats is not None
    assert not second.record and second.last_stats is None


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [5, 6, 7])
@pytest.mark.parametrize("shuffle", [False, True])
def test_real_rows_match_distributed_sampler_padding(world, n, shuffle):
    """The rows a rank holds that are not repeats, as DistributedSampler lays them out;
    a loader of whole-batch items (no batch_size) is left alone."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, DistributedSampler

    from bft_lightning.callbacks.recording import real_rows

    for rank in range(world):
        sampler = DistributedSampler(list(range(n)), world, rank, shuffle=shuffle)
        served = len(list(iter(sampler)))
        first_positions = range(rank, sampler.total_size, world)
        unique = sum(p < n for p in first_positions)
        rows = DataLoader(list(range(n)), batch_size=2, sampler=sampler)
        got = real_rows(SimpleNamespace(val_dataloaders=rows), "validate")  # type: ignore[arg-type]
        assert (served if got is None else got) == unique
        items = DataLoader(list(range(n)), batch_size=None, sampler=sampler)
        assert real_rows(SimpleNamespace(val_dataloaders=items), "validate") is None  # type: ignore[arg-type]
