"""Whether recommendations exclude the user's seen items when the caller does not say.

In Amazon Beauty, Sports and LastFM no test target repeats an item of its history,
yet a model left to rank seen items puts the user's own last item first for most
users (results/rec/FINDINGS.md): a list that repeats the history wastes its places.
Where repeats are common (re-orders, music plays) they are exactly what to
recommend. The checkpoint records its training data's repeat rate (the share of
training targets already in their history, ``SequenceDataModule.repeat_rate``);
below ``REPEAT_RATE_THRESHOLD`` seen items are excluded by default. An explicit
choice (``exclude_seen=``, ``--exclude-seen`` / ``--keep-seen``, a request's field)
always wins.
"""

from __future__ import annotations

REPEAT_RATE_THRESHOLD = 0.05  # Yelp's test targets repeat their history 6.7% of the time


def default_exclude_seen(repeat_rate: float | None) -> tuple[bool, str]:
    """``(exclude_seen, why)`` for a checkpoint with this repeat rate (None: not recorded)."""
    if repeat_rate is None:
        return False, (
            "seen items kept: the checkpoint does not record how often its training "
            "targets repeat their history (saved before it was)"
        )
    share = f"{100 * repeat_rate:.1f}% of the training targets repeat an item of their history"
    limit = f"{100 * REPEAT_RATE_THRESHOLD:.0f}%"
    if repeat_rate < REPEAT_RATE_THRESHOLD:
        return True, f"seen items excluded: {share} (under {limit})"
    return False, f"seen items kept: {share} ({limit} or more)"


def resolve_exclude_seen(explicit: bool | None, repeat_rate: float | None) -> tuple[bool, str]:
    """The caller's choice when given, else the checkpoint's default; and why."""
    if explicit is not None:
        return explicit, f"seen items {'excluded' if explicit else 'kept'}: as asked"
    return default_exclude_seen(repeat_rate)
