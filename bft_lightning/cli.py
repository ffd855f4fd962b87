"""``python -m bft_lightning fit|validate|test|predict --config X.yaml``.

A ``LightningCLI`` in subclass mode: ``model`` is a LightningModule
(``SequentialRecommendation``, with its backbone as a nested class), ``data``
a DataModule. Values only the data knows are linked, never typed twice:
``data.num_items -> model.init_args.num_items`` and ``data.max_len ->
model.init_args.max_len``.
"""

from __future__ import annotations

import os

from lightning.pytorch.cli import LightningCLI

import bft_lightning.callbacks  # noqa: F401  (short names for --trainer.callbacks)
import bft_lightning.datamodules  # noqa: F401
import bft_lightning.models  # noqa: F401
import bft_lightning.tasks  # noqa: F401


class BFTCLI(LightningCLI):
    """Links data-derived values into the model and checks the launch."""

    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.link_arguments("data.num_items", "model.init_args.num_items", apply_on="instantiate")
        parser.link_arguments("data.max_len", "model.init_args.max_len", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        check_launch(
            self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        )


def check_launch(config) -> None:  # type: ignore[no-untyped-def]
    """Refuse a launcher whose world size disagrees with ``devices x num_nodes``.

    Under ``torchrun`` with ``devices=1`` and the default strategy, each process
    would silently train its own copy of the model.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "LOCAL_WORLD_SIZE" not in os.environ:
        return
    trainer = config.get("trainer", {})
    devices, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes", 1) or 1)
    if isinstance(devices, int | str) and str(devices).isdigit():
        expected = int(devices) * nodes
        if expected != world:
            raise SystemExit(
                f"launcher world size WORLD_SIZE={world} but trainer.devices={devices} x "
                f"trainer.num_nodes={nodes} = {expected}; set them to match (e.g. "
                f"--trainer.devices={int(os.environ['LOCAL_WORLD_SIZE'])} --trainer.strategy=ddp)"
            )


def main(args: list[str] | None = None, run: bool = True) -> BFTCLI:
    """Entry point; ``args`` replaces ``sys.argv[1:]`` (for tests)."""
    return BFTCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": True},
        args=args,
        run=run,
    )
