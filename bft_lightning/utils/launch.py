"""The launch checked against the trainer's layout, before and after the trainer is built.

A run started by ``torchrun`` or by hand on several nodes must agree with
``trainer.devices x trainer.num_nodes``, else each process silently trains its
own copy of the model. :func:`check_launch` reads the config,
:func:`check_world_size` the built trainer.
"""

from __future__ import annotations

import os

from lightning.pytorch import Trainer

__all__ = ["check_launch", "check_world_size"]


def _launch_hint() -> str:
    local = os.environ.get("LOCAL_WORLD_SIZE", "N")
    return f"e.g. --trainer.devices={local} --trainer.num_nodes=<nodes> --trainer.strategy=ddp"


def check_launch(config) -> None:  # type: ignore[no-untyped-def]
    """Refuse a launch whose layout disagrees with ``trainer.devices x trainer.num_nodes``.

    - Under ``torchrun`` (``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` set) with
      ``devices=1`` and the default strategy, each process would silently train
      its own copy of the model: the world size must equal ``devices x num_nodes``.
    - Launched by hand on several nodes (``NODE_RANK`` set), ``NODE_RANK`` must
      be below ``num_nodes``.
    """
    trainer = config.get("trainer", {}) or {}
    devices, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes", 1) or 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torchrun = "LOCAL_WORLD_SIZE" in os.environ
    if torchrun and world > 1 and isinstance(devices, int | str) and str(devices).isdigit():
        expected = int(devices) * nodes
        if expected != world:
            raise SystemExit(
                f"launcher world size WORLD_SIZE={world} but trainer.devices={devices} x "
                f"trainer.num_nodes={nodes} = {expected}; set them to match ({_launch_hint()})"
            )
    if torchrun or "SLURM_NTASKS" in os.environ:
        return  # the launcher's own environment wins
    node_rank = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK"))
    if node_rank is not None and node_rank.isdigit() and int(node_rank) >= nodes:
        raise SystemExit(
            f"NODE_RANK={node_rank} but trainer.num_nodes={nodes}: node ranks run 0..num_nodes-1; "
            f"set --trainer.num_nodes to the number of nodes on every node"
        )


def check_world_size(trainer: Trainer) -> None:
    """After the trainer is built: its layout must fit the launcher.

    Under ``torchrun`` its process count must be the launcher's world size; this
    catches what the config check cannot see (``devices="auto"`` or ``-1``
    resolving to one device per process, ``strategy="auto"`` picking a
    single-device strategy): each process would train alone, on all the data.
    Launched by hand with ``num_nodes > 1``, ``MASTER_ADDR`` must be set (else
    every node waits for a master on its own localhost).
    """
    if "LOCAL_WORLD_SIZE" not in os.environ:
        if trainer.num_nodes > 1 and "SLURM_NTASKS" not in os.environ:
            if not os.environ.get("MASTER_ADDR"):
                raise SystemExit(
                    f"trainer.num_nodes={trainer.num_nodes} but MASTER_ADDR is not set: set "
                    "MASTER_ADDR (the address of node 0), MASTER_PORT and NODE_RANK on every node"
                )
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mine = trainer.num_nodes * trainer.num_devices
    if world > 1 and mine != world:
        raise SystemExit(
            f"launcher world size WORLD_SIZE={world} but the trainer runs "
            f"{trainer.num_nodes} node(s) x {trainer.num_devices} device(s) = {mine} process(es) "
            f"with {type(trainer.strategy).__name__}; each process would train its own copy. "
            f"Set them to match ({_launch_hint()})"
        )
