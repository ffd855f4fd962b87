"""Lightning callbacks that make BFT observable, on any LightningModule.

They find BFT layers by the recording protocol (``bft_lightning.nn.FilterRecorder``)
and switch recording on only for the batches they measure.

- ``PrecisionMonitor``: histograms and summaries of log lambda, lambda_obs, K,
  n_eff, Jbar and Q per layer during training (and validation).
- ``AttentionSinkMonitor``: sink mass ``alpha_1`` and ``Sink_1`` per layer and head.
- ``GainByContextLength``: mean K, n_eff and gate by context length.
- ``GainByStratum``: mean K and prior precision by item-popularity quartile.
- ``RunSummary``: a line per validation epoch, the stop reason and the checkpoint
  paths after ``fit``, the metrics table after ``test`` (the CLI adds it).
"""

from bft_lightning.callbacks.attention_sink import AttentionSinkMonitor
from bft_lightning.callbacks.eval_recorder import EvalRecorder
from bft_lightning.callbacks.gain_by_context import GainByContextLength
from bft_lightning.callbacks.gain_by_stratum import GainByStratum
from bft_lightning.callbacks.precision_monitor import PrecisionMonitor
from bft_lightning.callbacks.summary import RunSummary

__all__ = [
    "AttentionSinkMonitor",
    "EvalRecorder",
    "GainByContextLength",
    "GainByStratum",
    "PrecisionMonitor",
    "RunSummary",
]
