"""Evaluation metrics: full-ranking HR/NDCG/MRR by stratum, reports.

Ranks come from :mod:`bft_lightning.retrieval`; see :mod:`bft_lightning.metrics.ranking`
for the tie rule and the key scheme.
"""

from bft_lightning.metrics.ranking import (
    DEFAULT_KS,
    RankingMetric,
    hr_ndcg_mrr,
    summarise_ranks,
    target_ranks,
)
from bft_lightning.metrics.report import compare_table, read_metrics, strata_table, write_report
from bft_lightning.metrics.strata import (
    assign_item_stratum,
    assign_quartile,
    assign_user_bucket,
    history_buckets,
    popularity_quartiles,
    quartile_boundaries,
)

__all__ = [
    "DEFAULT_KS",
    "RankingMetric",
    "assign_item_stratum",
    "assign_quartile",
    "assign_user_bucket",
    "compare_table",
    "history_buckets",
    "hr_ndcg_mrr",
    "popularity_quartiles",
    "quartile_boundaries",
    "read_metrics",
    "strata_table",
    "summarise_ranks",
    "target_ranks",
    "write_report",
]
