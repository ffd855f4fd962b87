"""Evaluation metrics: full-ranking HR/NDCG/MRR by stratum, top-k paths, reports.

See :mod:`bft_lightning.metrics.ranking` for the tie rule and the key scheme.
"""

from bft_lightning.metrics.ranking import (
    DEFAULT_KS,
    RankingMetric,
    chunked_target_ranks,
    faiss_topk,
    fast_bf16_matmul,
    hr_ndcg_mrr,
    ranks_from_topk,
    summarise_ranks,
    target_ranks,
    tiled_target_ranks,
    topk_metrics,
    topk_rows,
    torch_topk_chunked,
    torch_topk_tiled,
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
    "chunked_target_ranks",
    "compare_table",
    "faiss_topk",
    "fast_bf16_matmul",
    "history_buckets",
    "hr_ndcg_mrr",
    "popularity_quartiles",
    "quartile_boundaries",
    "ranks_from_topk",
    "read_metrics",
    "strata_table",
    "summarise_ranks",
    "target_ranks",
    "tiled_target_ranks",
    "topk_metrics",
    "topk_rows",
    "torch_topk_chunked",
    "torch_topk_tiled",
    "write_report",
]
