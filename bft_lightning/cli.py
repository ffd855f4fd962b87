"""``python -m bft_lightning fit|validate|test|predict --config X.yaml``.

A ``LightningCLI`` in subclass mode: ``model`` is a LightningModule
(``SequentialRecommendation``, with its backbone as a nested class), ``data``
a DataModule. Values only the data knows are linked, never typed twice:
``data.num_items -> model.init_args.num_items`` and ``data.max_len ->
model.init_args.max_len``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import bft_lightning.callbacks  # noqa: F401  (short names for --trainer.callbacks)
import bft_lightning.datamodules  # noqa: F401
import bft_lightning.models  # noqa: F401
import bft_lightning.tasks  # noqa: F401
from bft_lightning.utils.checkpoint_io import safe_load_checkpoint
from bft_lightning.utils.errors import run_with_clear_errors

PROG = "python -m bft_lightning"

_MAIN_HELP = """Train and evaluate sequential recommenders and language models with BFT.

  python -m bft_lightning fit  --config configs/experiments/sasrec_on_synthetic.yaml
  python -m bft_lightning fit  --config ... --ckpt_path last    # continue that run
  python -m bft_lightning test --config ... --ckpt_path best    # test its best checkpoint

`<subcommand> --help` leads with the options that matter; --debug shows tracebacks."""

# what ``<subcommand> --help`` shows first, before the full list of options
_USAGE = {
    "fit": "--config CONFIG.yaml [--ckpt_path last|PATH] [--trainer.max_epochs N] [options]",
    "validate": "--config CONFIG.yaml --ckpt_path last|best|PATH [options]",
    "test": "--config CONFIG.yaml --ckpt_path last|best|PATH [options]",
    "predict": "--config CONFIG.yaml --ckpt_path last|best|PATH [options]",
}
_LEAD = """The options that matter most:
  --config FILE               an experiment (configs/experiments/*.yaml); repeat to layer files
  --ckpt_path last|best|PATH  continue (fit) or evaluate a run: `last`/`best` take the newest
                              run under the logger's folder and write into that run's folder
  --trainer.max_epochs N      the epoch cap (early stopping usually ends a run first)
  --trainer.accelerator/devices/precision   where and how to run (cpu, gpu, bf16-mixed ...)
  --data.init_args.data_root DIR            the data sets ($BFT_DATA_ROOT, else ./data)
  --model.init_args.lr LR, --model.init_args.backbone.init_args.precision on|off
  --print_config              print the full resolved config and exit
  --debug                     show the full traceback of an error (or set BFT_DEBUG=1)
Every other option follows; docs/cli.md describes output, resume and errors."""


class BFTCLI(LightningCLI):
    """Links data-derived values into the model and checks the launch."""

    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.link_arguments("data.num_items", "model.init_args.num_items", apply_on="instantiate")
        parser.link_arguments("data.max_len", "model.init_args.max_len", apply_on="instantiate")

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> Any:
        kwargs.setdefault("usage", f"{PROG} {subcommand} {_USAGE.get(subcommand, '[options]')}")
        kwargs["description"] = f"{kwargs.get('description') or ''}\n\n{_LEAD}".strip()
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand in ("validate", "test"):
            # the run's own table (RunSummary, metrics.md) replaces Lightning's 100-row print
            parser.set_defaults(verbose=False)
        return parser

    def before_instantiate_classes(self) -> None:
        check_launch(
            self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        saved = sys.argv
        if args is not None:  # given explicitly: the process's own argv is not ours to read
            sys.argv = saved[:1]  # (LightningCLI would warn about both, once per call)
        try:
            super().parse_arguments(parser, args)
        finally:
            sys.argv = saved
        subcommand = self.config.get("subcommand")
        if subcommand:
            from bft_lightning.utils.run_dir import pin_run

            pin_run(self.config[subcommand], subcommand)
        self._checkpoint = self._read_checkpoint()
        self._use_checkpoint_vocabulary()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        from bft_lightning.callbacks.summary import RunSummary

        trainer = super().instantiate_trainer(**kwargs)
        check_world_size(trainer)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, RunSummary) for c in callbacks):
            callbacks.append(RunSummary())
        if self.subcommand not in (None, "fit"):
            for callback in callbacks:  # `test` into a run's folder keeps its fit config
                if isinstance(callback, SaveConfigCallback):
                    callback.config_filename = f"config_{self.subcommand}.yaml"
        return trainer

    def _use_checkpoint_vocabulary(self) -> None:
        """Encode the data in ``--ckpt_path``'s item vocabulary (``data.item_vocabulary``).

        Set before anything is built, so the item count linked into the model is the
        checkpoint's even when the data has items it never saw (those are dropped, with
        a warning that counts them). Left alone when the config sets it.
        """
        path, checkpoint = self._ckpt_path(), getattr(self, "_checkpoint", None)
        vocabulary = ((checkpoint or {}).get("bft_lightning") or {}).get("vocabulary")
        if path is None or not vocabulary:
            return
        init = (self.config[self.config["subcommand"]].get("data") or {}).get("init_args")
        if init is not None and "item_vocabulary" in init:
            if init.get("item_vocabulary") is None:
                init["item_vocabulary"] = path

    def _ckpt_path(self) -> str | None:
        """``--ckpt_path`` when it names a local file (not ``last``/``best``/a URL)."""
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if path is None or str(path) in ("last", "best", "hpc", "registry") or "://" in str(path):
            return None
        return str(path)

    def _read_checkpoint(self) -> dict[str, Any] | None:
        """Load ``--ckpt_path`` safely before LightningCLI reads its hyperparameters.

        A missing, truncated, corrupt or unsafe file, or one saved from another
        LightningModule class than the config builds, stops here with a message
        naming the file, before anything is instantiated or written.
        """
        path = self._ckpt_path()
        if path is None:
            return None
        try:
            checkpoint = safe_load_checkpoint(path)
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"error: --ckpt_path {err}") from None
        saved = (checkpoint.get("hyper_parameters") or {}).get("_class_path")
        model = self.config[self.config["subcommand"]].get("model")
        wanted = model.get("class_path") if hasattr(model, "get") else None
        if saved and wanted and not _related(_resolve(saved), _resolve(wanted)):
            raise SystemExit(
                f"error: --ckpt_path {path}: checkpoint from another model: saved from "
                f"{saved}, the config builds {wanted}"
            )
        return checkpoint

    def _check_checkpoint(self) -> None:
        """Check ``--ckpt_path`` against the built model before anything runs or is written."""
        path, checkpoint = self._ckpt_path(), getattr(self, "_checkpoint", None)
        check = getattr(self.model, "check_checkpoint", None)
        if path is None or checkpoint is None or check is None:
            return
        try:
            check(checkpoint, path)
        except ValueError as err:
            raise SystemExit(f"error: --ckpt_path {err}") from None

    def before_fit(self) -> None:
        self._check_checkpoint()

    def before_validate(self) -> None:
        self._check_checkpoint()

    def before_test(self) -> None:
        self._check_checkpoint()

    def before_predict(self) -> None:
        self._check_checkpoint()
        from bft_lightning.serving import RecommendationWriter

        callbacks = getattr(self.trainer, "callbacks")  # noqa: B009 - not in Trainer's stubs
        if hasattr(self.model, "predict_k") and not any(
            isinstance(c, RecommendationWriter) for c in callbacks
        ):  # the recommendations go to a file (predictions.csv in the log folder)
            callbacks.append(RecommendationWriter())
        config = self.config_init.get("predict", {})
        if hasattr(self.model, "predict_k") and config.get("return_predictions") is None:
            config["return_predictions"] = False  # written by the writer, not kept in memory


def _resolve(class_path: str) -> object:
    """The object a dotted path names, or the path itself if it does not import."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return class_path


def _related(a: object, b: object) -> bool:
    """Same class, or one a subclass of the other (unresolved paths: equal strings)."""
    if isinstance(a, type) and isinstance(b, type):
        return issubclass(a, b) or issubclass(b, a)
    return a == b


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


class _LeadFormatter(DefaultHelpFormatter):
    """Keeps the line breaks of the description (the options that matter most)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def main(args: list[str] | None = None, run: bool = True, *, exit_on_error: bool = True) -> Any:
    """The CLI; ``args`` replaces ``sys.argv[1:]`` (for tests). Errors propagate.

    ``exit_on_error=False`` makes a parse error raise (jsonargparse's
    ``ArgumentError``) instead of printing the usage and exiting; :func:`entry`
    uses it to print one line instead.

    ``recommend`` runs :mod:`bft_lightning.serving.cli`, ``calibrate``
    :mod:`bft_lightning.serving.calibrate_cli`, ``serve`` and ``export``
    :mod:`~bft_lightning.serving.serve_cli` and :mod:`~bft_lightning.serving.export_cli`;
    each exits with its status.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "recommend":
        from bft_lightning.serving.cli import main as recommend

        raise SystemExit(recommend(argv[1:]))
    if argv and argv[0] == "calibrate":
        from bft_lightning.serving.calibrate_cli import main as calibrate

        raise SystemExit(calibrate(argv[1:]))
    if argv and argv[0] == "serve":
        from bft_lightning.serving.serve_cli import main as serve

        raise SystemExit(serve(argv[1:]))
    if argv and argv[0] == "export":
        from bft_lightning.serving.export_cli import main as export

        raise SystemExit(export(argv[1:]))
    per_command = {"exit_on_error": exit_on_error}
    parser_kwargs: dict[str, Any] = {
        "default_env": True, "prog": PROG, "formatter_class": _LeadFormatter,
        "description": _MAIN_HELP, **per_command,
    }  # fmt: skip
    parser_kwargs.update({name: dict(per_command) for name in _USAGE})
    return BFTCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=parser_kwargs,
        args=args,
        run=run,
    )


def entry(argv: Sequence[str] | None = None) -> None:
    """``python -m bft_lightning`` and the ``bft-lightning`` script.

    Known third-party warnings are filtered (:mod:`bft_lightning.utils.noise`);
    a bad input ends with one ``error:`` line on stderr and exit code 2, no
    traceback (``--debug`` or ``BFT_DEBUG=1``: the full traceback, no filters).
    """
    from bft_lightning.utils.errors import debug_requested
    from bft_lightning.utils.noise import quiet_third_party

    args = list(sys.argv[1:] if argv is None else argv)
    if not debug_requested(args)[0]:
        quiet_third_party()

    def call(rest: list[str]) -> None:
        if argv is None:  # LightningCLI reads sys.argv itself (args= as well would warn)
            sys.argv[1:] = rest
            main(None, exit_on_error=False)
        else:
            main(rest, exit_on_error=False)

    code = run_with_clear_errors(call, args)
    if code:
        raise SystemExit(code)


def run() -> None:
    """The ``bft-lightning`` console script: :func:`entry` with the process's arguments.

    Returns None on success, so the script exits 0 (``sys.exit`` of the CLI
    object would be an error exit); a bad input exits 2."""
    entry()
