"""Remapping, leave-one-out rules and the padded train / eval arrays."""

from __future__ import annotations

import numpy as np
import pytest

from bft_lightning.datamodules.readers import InteractionLog
from bft_lightning.datamodules.splits import (
    encode,
    eval_arrays,
    leave_one_out,
    left_pad,
    train_arrays,
)


def _log() -> InteractionLog:
    seqs = [["c", "a", "b", "d", "e"], ["x"], ["a", "x"], ["e", "c", "f"], list("ghijklmnop")]
    times = [[10 * k + 1 for k in range(len(s))] for s in seqs]
    return InteractionLog(["u0", "u1", "u2", "u3", "u4"], seqs, times)


def _user_items(data, u: int) -> list[int]:
    return data.items[data.offsets[u] : data.offsets[u + 1]].tolist()


def test_encode_first_appearance_and_padding():
    data = encode(_log())
    assert _user_items(data, 0) == [1, 2, 3, 4, 5]  # c a b d e
    assert _user_items(data, 1) == [6]  # x
    assert _user_items(data, 3) == [5, 1, 7]  # e c f
    assert data.num_items == 17 and data.item_ids[0] == "" and data.item_ids[1] == "c"
    assert data.items.min() == 1 and data.user_ids.tolist() == ["u0", "u1", "u2", "u3", "u4"]


def test_short_users_train_only_and_frequency_from_train_part():
    data = encode(_log())
    split = leave_one_out(data)
    assert split.num_short_users == 2  # u1 (1 item), u2 (2 items)
    assert split.eval_users.tolist() == [0, 3, 4]
    assert split.num_untrainable_users == 2  # u1 (1 item), u3 (train part [e])
    freq = split.item_frequency
    assert freq.shape == (data.num_items + 1,) and freq[0] == 0
    # train parts: [c a b], [x], [a x], [e], [g..n]; val/test targets d e / c f / o p excluded
    expected = {1: 1, 2: 2, 3: 1, 5: 1, 6: 2}
    expected.update({data.item_ids.tolist().index(ch): 1 for ch in "ghijklmn"})
    assert {i: int(c) for i, c in enumerate(freq) if c} == expected


def test_left_pad_matches_python():
    rng = np.random.default_rng(0)
    values = rng.integers(1, 100, size=200)
    start = rng.integers(0, 150, size=40)
    end = start + rng.integers(0, 50, size=40)
    out = left_pad(values, start, end, 7)
    for row, s, e in zip(out, start, end):
        tail = values[max(s, e - 7) : e].tolist()
        assert row.tolist() == [0] * (7 - len(tail)) + tail


@pytest.mark.parametrize("max_len", [2, 4, 50])
def test_train_rows_hold_every_prefix_target_or_the_recent_window(max_len):
    data = encode(_log())
    split = leave_one_out(data)
    arrays = train_arrays(data, split, max_len)
    assert arrays["seq"].shape[1] == max_len + 1
    assert arrays["user"].tolist() == [0, 2, 4]  # users with >= 2 training items
    for row, times, u in zip(arrays["seq"], arrays["seq_time"], arrays["user"]):
        items = _user_items(data, u)
        train = items[:-2] if len(items) >= 3 else items
        kept = train[-(max_len + 1) :]
        assert row.tolist() == [0] * (max_len + 1 - len(kept)) + kept  # left pad, most recent
        assert ((times == 0) == (row == 0)).all()
        targets = row[1:][row[:-1] != 0].tolist()  # targets whose input is a real item
        if len(train) <= max_len + 1:  # every non-empty training prefix has its target
            assert targets == train[1:]


@pytest.mark.parametrize("max_len", [2, 4, 50])
def test_prefix_rows_one_per_target_ending_at_it(max_len):
    data = encode(_log())
    split = leave_one_out(data)
    arrays = train_arrays(data, split, max_len, rows="prefix")
    expected, target_times = [], []  # (user, the most recent max_len + 1 items up to a target)
    for u in range(data.num_users):
        items = _user_items(data, u)
        train = items[:-2] if len(items) >= 3 else items
        for t in range(1, len(train)):
            kept = train[max(0, t - max_len) : t + 1]
            expected.append((u, [0] * (max_len + 1 - len(kept)) + kept))
            target_times.append(int(data.times[data.offsets[u] + t]))
    got = list(zip(arrays["user"].tolist(), arrays["seq"].tolist()))
    assert got == expected  # every training target once, including those a window cuts off
    assert (arrays["num_targets"] == 1).all()
    assert ((arrays["seq_time"] == 0) == (arrays["seq"] == 0)).all()
    assert arrays["seq_time"][:, -1].tolist() == target_times


def test_train_rows_are_checked():
    data = encode(_log())
    with pytest.raises(ValueError, match="rows must be"):
        train_arrays(data, leave_one_out(data), 3, rows="window")


def test_eval_rows_no_leakage_and_alignment():
    data = encode(_log())
    split = leave_one_out(data)
    val, test = (eval_arrays(data, split, 3, s) for s in ("val", "test"))
    assert val["user"].tolist() == test["user"].tolist() == [0, 1, 2]
    for r, u in enumerate(split.eval_users):
        items = _user_items(data, u)
        times = data.times[data.offsets[u] : data.offsets[u + 1]].tolist()
        assert test["target"][r] == items[-1] and val["target"][r] == items[-2]
        assert test["input_ids"][r, -1] == val["target"][r]  # val target ends the test input
        assert items[-1] not in val["input_ids"][r] and items[-1] not in test["input_ids"][r]
        assert val["history_len"][r] == len(items) - 2 and test["history_len"][r] == len(items) - 1
        assert val["input_ids"][r].tolist()[-min(3, len(items) - 2) :] == items[:-2][-3:]
        assert test["target_time"][r] == times[-1] and test["input_time"][r, -1] == times[-2]
    assert test["input_ids"][2].tolist() == _user_items(data, 4)[-4:-1]  # 3 most recent


def test_eval_stage_is_checked():
    data = encode(_log())
    with pytest.raises(ValueError, match="stage"):
        eval_arrays(data, leave_one_out(data), 3, "train")


def test_no_timestamps_no_time_keys():
    data = encode(InteractionLog([1, 2], [[1, 2, 3, 4], [5, 6, 7]]))
    split = leave_one_out(data)
    assert set(train_arrays(data, split, 5)) == {"seq", "user"}
    assert set(eval_arrays(data, split, 5, "test")) == {
        "input_ids",
        "target",
        "user",
        "history_len",
    }


def _repeat_rate_by_loop(data, split) -> float:
    """The definition, one user at a time: training targets already in their history."""
    repeats = targets = 0
    for u in range(data.num_users):
        part = data.items[split.train_start[u] : split.train_end[u]].tolist()
        for t in range(1, len(part)):
            targets += 1
            repeats += part[t] in part[:t]
    return repeats / targets if targets else 0.0


def test_repeat_rate_counts_training_targets_already_in_their_history():
    from bft_lightning.datamodules.splits import repeat_rate

    seqs = [list("abab") + ["v", "w"], list("aaaa") + ["v", "w"], list("abc"), ["z"], list("cd")]
    log = InteractionLog([f"u{i}" for i in range(5)], seqs, None)
    data = encode(log)
    split = leave_one_out(data)
    # training parts: abab (targets b a b: a, b repeat), aaaa (3 repeats), a (none),
    # z (short: trains, no target), cd (short: c -> d, no repeat): 5 of 3 + 3 + 1 = 7
    assert repeat_rate(data, split) == pytest.approx(5 / 7)
    assert repeat_rate(data, split) == pytest.approx(_repeat_rate_by_loop(data, split))
    rng = np.random.default_rng(0)
    rand = [[str(x) for x in rng.integers(0, 12, rng.integers(1, 30))] for _ in range(200)]
    data = encode(InteractionLog([str(i) for i in range(200)], rand, None))
    split = leave_one_out(data)
    assert repeat_rate(data, split) == pytest.approx(_repeat_rate_by_loop(data, split))
    no_repeat = encode(InteractionLog(["a", "b"], [list("pqrst"), list("uvw")], None))
    assert repeat_rate(no_repeat, leave_one_out(no_repeat)) == 0.0
