"""RankingMetric: strata on a constructed case, and DDP exactness with sampler padding."""

import json
import math
import multiprocessing as mp
import socket

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from bft_lightning.metrics.ranking import RankingMetric
from bft_lightning.metrics.strata import history_buckets

KS = (1, 5, 10, 20)


def same(a: dict, b: dict) -> bool:
    """Exact equality of two metric dicts, NaN == NaN."""
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


# ----------------------------------------------------------------------------- strata
def constructed():
    """8 users; item i scores -i, so target t has rank t - 1 (ranks 0..7)."""
    freq = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])  # items 1..8 -> Q0 {1,2} .. Q3 {7,8}
    target = torch.arange(1, 9)  # user u -> item u + 1
    scores = -torch.arange(9.0).expand(8, 9)  # (8, 9)
    hist = torch.tensor([4, 4, 3, 3, 2, 2, 1, 1])  # cold users B0 = {6, 7}
    gain = torch.arange(8) / 10
    return freq, target, scores, hist, gain


def test_strata_on_constructed_case():
    freq, target, scores, hist, gain = constructed()
    m = RankingMetric(8, item_frequency=freq, user_boundaries=history_buckets(hist), ks=KS)
    m.update(scores[:5], target[:5], torch.arange(5), hist[:5], gain[:5])
    m.update(scores[5:], target[5:], torch.arange(5, 8), hist[5:], gain[5:])
    out = m.compute()
    assert out["n"] == 8 and out["hr@1"] == 1 / 8 and out["hr@5"] == 5 / 8
    assert out["mrr"] == pytest.approx(sum(1 / (r + 1) for r in range(8)) / 8)
    assert out["item_q0/hr@1"] == 0.5 and out["item_q0/mrr"] == pytest.approx(0.75)
    assert out["item_q3/hr@5"] == 0.0 and out["item_q3/hr@10"] == 1.0
    assert out["item_q3/ndcg@10"] == pytest.approx((1 / math.log2(8) + 1 / math.log2(9)) / 2)
    assert out["user_b0/hr@5"] == 0.0 and out["user_b3/hr@1"] == 0.5  # B3 = users 0, 1
    assert out["item_q0/gain"] == pytest.approx(0.05) and out["gain"] == pytest.approx(0.35)
    assert all(out[f"{s}{j}/n"] == 2 for s in ("item_q", "user_b") for j in range(4))


def test_boundaries_default_to_seen_users_and_keys_without_extras():
    freq, target, scores, hist, _ = constructed()
    m = RankingMetric(8, item_frequency=freq)
    m.update(scores, target, torch.arange(8), hist)
    with_default = m.compute()
    m2 = RankingMetric(8, item_frequency=freq, user_boundaries=history_buckets(hist))
    m2.update(scores, target, torch.arange(8), hist)
    assert same(with_default, m2.compute())
    plain = RankingMetric(8)
    plain.update(scores, target, torch.arange(8))
    keys = plain.compute().keys()
    assert "gain" not in keys and not any("/" in k for k in keys)


def test_duplicates_and_partial_strata():
    freq, target, scores, hist, gain = constructed()
    m = RankingMetric(10, item_frequency=freq)  # users 8, 9 never seen
    for _ in range(2):  # every user twice, in a different batch order
        perm = torch.randperm(8)
        m.update(scores[perm], target[perm], perm, hist[perm])
    out = m.compute()
    assert out["n"] == 8 and out["hr@5"] == 5 / 8
    with pytest.raises(ValueError, match="user ids"):
        m.update(scores[:1], target[:1], torch.tensor([10]))


def test_empty_stratum_is_nan_with_zero_count():
    freq, target, scores, hist, _ = constructed()
    m = RankingMetric(8, item_frequency=freq)
    m.update(scores[:2], target[:2], torch.arange(2))  # only Q0 targets
    out = m.compute()
    assert out["item_q3/n"] == 0 and math.isnan(out["item_q3/hr@10"])
    assert out["item_q0/n"] == 2


# ----------------------------------------------------------------------------- DDP
NUM_USERS, NUM_ITEMS, WORLD = 21, 30, 2


def ddp_data():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 8, (NUM_USERS, NUM_ITEMS + 1), generator=g).float()  # ties
    target = torch.randint(1, NUM_ITEMS + 1, (NUM_USERS,), generator=g)
    hist = torch.randint(1, 50, (NUM_USERS,), generator=g)
    gain = torch.rand(NUM_USERS, generator=g)
    freq = torch.randint(0, 100, (NUM_ITEMS + 1,), generator=g)
    return scores, target, hist, gain, freq


def run_metric(users: torch.Tensor, batch: int) -> dict:
    scores, target, hist, gain, freq = ddp_data()
    m = RankingMetric(NUM_USERS, item_frequency=freq, user_boundaries=history_buckets(hist))
    for u in users.split(batch):
        m.update(scores[u], target[u], u, hist[u], gain[u])
    return m.compute()


def padded_shards() -> list[torch.Tensor]:
    """DistributedSampler(shuffle=False): pad to a multiple of WORLD by repeating the start."""
    idx = list(range(NUM_USERS))
    idx += idx[: (-NUM_USERS) % WORLD]
    return [torch.tensor(idx[r::WORLD]) for r in range(WORLD)]


def _worker(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        queue.put((rank, run_metric(padded_shards()[rank], batch=4)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_equal_one_process_with_padding():
    shards = padded_shards()
    assert sum(len(s) for s in shards) == NUM_USERS + 1  # one duplicate user
    single = run_metric(torch.arange(NUM_USERS), batch=5)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=60) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    assert single["n"] == NUM_USERS
    for rank in range(WORLD):
        assert same(results[rank], single), rank


class _EvalOnly(L.LightningModule):
    """Scores come from the table in ``ddp_data``; the metric is the only thing under test."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        scores, target, hist, gain, freq = ddp_data()
        self.data = (scores, target, hist, gain)
        self.metric = RankingMetric(NUM_USERS, freq, user_boundaries=history_buckets(hist))
        self.out_dir = out_dir

    def validation_step(self, batch, batch_idx):
        (u,) = batch
        scores, target, hist, gain = self.data
        self.metric.update(scores[u], target[u], u, hist[u], gain[u])

    def on_validation_epoch_end(self):
        out = self.metric.compute()
        self.metric.reset()
        if self.trainer.is_global_zero:
            with open(f"{self.out_dir}/{self.trainer.world_size}.json", "w") as f:
                json.dump(out, f)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore:.*LeafSpec.*")
def test_lightning_ddp_fork_validate_matches_single_process(tmp_path):
    """Lightning's own DistributedSampler pads 21 users to 22 over 2 ranks."""
    loader = DataLoader(TensorDataset(torch.arange(NUM_USERS)), batch_size=4)
    for devices, strategy in ((1, "auto"), (WORLD, "ddp_fork")):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.validate(_EvalOnly(str(tmp_path)), loader, verbose=False)
    one, two = (json.loads((tmp_path / f"{d}.json").read_text()) for d in (1, WORLD))
    assert one["n"] == NUM_USERS and same(one, two)
    assert same(one, run_metric(torch.arange(NUM_USERS), batch=5))
