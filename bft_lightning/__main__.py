"""``python -m bft_lightning fit --config configs/experiments/X.yaml``."""

from bft_lightning.cli import entry

if __name__ == "__main__":
    entry()
