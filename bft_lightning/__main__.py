"""``python -m bft_lightning fit --config configs/experiments/X.yaml``."""

from bft_lightning.cli import main

if __name__ == "__main__":
    main()
