"""Known third-party noise, filtered at the command line's entry only.

:func:`quiet_third_party` is called by ``python -m bft_lightning`` and the quick
start before anything is imported that could print; it is never called on
import of the package, so a program or a test that uses the library sees every
warning. Each filter names one message, matched from its start, and says why it
is safe to drop (``docs/cli.md`` lists them too). ``--debug`` or ``BFT_DEBUG=1``
turns all of them off.
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["FILTERS", "quiet_third_party"]

# (message regex (matched at its start), category, module regex, why it is safe to drop)
FILTERS: tuple[tuple[str, type[Warning], str, str], ...] = (
    (
        r"\s*skip_none parameter was deprecated",
        Warning,
        r"",
        "Lightning's SaveConfigCallback calls jsonargparse's dump(skip_none=...): not ours",
    ),
    (
        r"\s*By default only one JsonargparseDeprecationWarning per type is shown",
        Warning,
        r"",
        "the footnote of the jsonargparse warning above",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        Warning,
        r"",
        "Lightning's pytree helpers call an API torch deprecated; nothing for a user to change",
    ),
    (
        r"The number of training batches \(\d+\) is smaller than the logging interval",
        Warning,
        r"",
        "small data sets log once per epoch instead; the epoch summary line is printed anyway",
    ),
    (
        r".*License classifiers are deprecated",
        Warning,
        r"",
        "packaging metadata of an installed dependency; unrelated to a run",
    ),
    (
        r"`?[Ll]icense`? .*(deprecated|TOML table)",
        Warning,
        r"",
        "the same setuptools licence notice in its other wording",
    ),
    (
        r"Checkpoint directory .* exists and is not empty",
        Warning,
        r"",
        "a resumed run (--ckpt_path) writes on into its own checkpoint folder by design",
    ),
    (
        r"The dirpath has changed from",
        Warning,
        r"",
        "a resumed run's checkpoint folder is pinned to its run (utils.run_dir) by design",
    ),
    (
        r"It is recommended to use `self\.log\(.*sync_dist=True\)`",
        Warning,
        r"",
        "epoch-level metrics are reduced by the metric objects themselves, across processes",
    ),
    (
        r".*does not have many workers which may be a bottleneck",
        Warning,
        r"",
        "the data sets are in memory: worker processes would only add start-up time",
    ),
)

# Lightning's INFO lines dropped: the advertisements of its cloud logger (every run) and
# of its cloud checkpoints (a run without a ModelCheckpoint of its own), and why `fit`
# stopped, which the run's summary says in full (callbacks/summary.py) after the progress
# bar, where this line, logged while the bar is drawn, would break it
_DROPPED_PREFIXES = (
    "\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud ",  # "logging ...", "uploads ..."
    "`Trainer.fit` stopped:",
)


class _DropTip(logging.Filter):
    """Drops the lines above; takes the "0 Total Flops" line (nothing measured) out of the
    model summary."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if "Total Flops" in text:
            record.msg = "\n".join(
                line for line in text.split("\n") if not re.match(r"^0\s+Total Flops", line)
            )
        return not text.startswith(_DROPPED_PREFIXES)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # type: ignore[no-untyped-def]
    """``warning: <message>``: where in a library it was raised is not the user's business
    (``--debug`` shows the usual form)."""
    return f"warning: {message}\n"


def quiet_third_party() -> None:
    """Install the filters of :data:`FILTERS` and drop Lightning's litlogger tip."""
    for message, category, module, _why in FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    warnings.formatwarning = _one_line_warning
    for name in (
        "lightning.pytorch.utilities.rank_zero",
        "lightning.fabric.utilities.rank_zero",
        "lightning.pytorch.callbacks.model_summary",  # logs its table itself, not through those
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTip) for f in logger.filters):
            logger.addFilter(_DropTip())
