"""Backbones: sequential recommenders (and the Llama-style LM)."""

from bft_lightning.models.base import SequentialRecommender
from bft_lightning.models.bert4rec import BERT4Rec
from bft_lightning.models.hstu import HSTU
from bft_lightning.models.sasrec import SASRec

__all__ = ["BERT4Rec", "HSTU", "SASRec", "SequentialRecommender"]
