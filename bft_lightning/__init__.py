"""bft-lightning: the Bayesian Filtering Transformer on PyTorch Lightning."""

__version__ = "0.1.0"
