"""``python -m bft_lightning fit|validate|test|predict --config X.yaml``.

A ``LightningCLI`` in subclass mode: ``model`` is a LightningModule
(``SequentialRecommendation``, with its backbone as a nested class), ``data``
a DataModule. Values only the data knows are linked, never typed twice:
``data.num_items -> model.init_args.num_items`` and ``data.max_len ->
model.init_args.max_len``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import bft_lightning.callbacks  # noqa: F401  (short names for --trainer.callbacks)
import bft_lightning.datamodules  # noqa: F401
import bft_lightning.models  # noqa: F401
import bft_lightning.tasks  # noqa: F401
from bft_lightning.models.base import fold_flat_filter_options
from bft_lightning.utils.checkpoint_io import safe_load_checkpoint
from bft_lightning.utils.errors import run_with_clear_errors
from bft_lightning.utils.launch import check_launch, check_world_size

PROG = "python -m bft_lightning"

_MAIN_HELP = """Train and evaluate sequential recommenders and language models with BFT.

  python -m bft_lightning fit  --config configs/experiments/sasrec_on_synthetic.yaml
  python -m bft_lightning fit  --config ... --ckpt_path last    # continue that run
  python -m bft_lightning test --config ... --ckpt_path best    # test its best checkpoint
  python -m bft_lightning tune --config ... --search configs/search/sasrec_off.yaml --trials 12

Subcommands:
{subcommands}

`<subcommand> --help` leads with the options that matter; --debug shows tracebacks."""

# one line each, for `--help`; recommend ... export run their own parsers
SUBCOMMANDS = {
    "fit": "train a model (--ckpt_path last continues a run)",
    "validate": "evaluate a checkpoint on the validation users",
    "test": "evaluate a checkpoint on the test users; writes metrics.md",
    "predict": "write every user's next top-k items to a file (predictions.csv)",
    "recommend": "top-k next items for the histories of a file, from a checkpoint",
    "calibrate": "fit a checkpoint's confidence to P(hit@k) on held-out users",
    "tune": "search hyperparameters: each trial is a fit",
    "serve": "answer recommendation requests over HTTP from a checkpoint",
    "export": "write a checkpoint's model in a portable format",
}
_MAIN_HELP = _MAIN_HELP.format(
    subcommands="\n".join(f"  {name:<10} {text}" for name, text in SUBCOMMANDS.items())
)

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

    def _add_subcommands(self, parser: Any, **kwargs: Any) -> None:
        """LightningCLI's subcommands, described in one whole line each (:data:`SUBCOMMANDS`)."""
        self._subcommand_parsers = {}
        subcommands = parser.add_subcommands()
        for subcommand in self.subcommands():
            description = SUBCOMMANDS.get(subcommand, subcommand)
            options = dict(kwargs.get(subcommand, {}))
            options.setdefault("description", description)
            sub = self._prepare_subcommand_parser(Trainer, subcommand, **options)
            self._subcommand_parsers[subcommand] = sub
            subcommands.add_subcommand(subcommand, sub, help=description)

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> Any:
        from jsonargparse import ActionYesNo

        kwargs.setdefault("usage", f"{PROG} {subcommand} {_USAGE.get(subcommand, '[options]')}")
        kwargs["description"] = f"{kwargs.get('description') or ''}\n\n{_LEAD}".strip()
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        parser.add_argument(
            "--allow_other_data", action=ActionYesNo, default=False,
            help="use --ckpt_path with data it was not trained on (another fingerprint with "
            "little overlap, or another reader format); off: an error naming both",
        )  # fmt: skip
        if subcommand in ("validate", "test", "predict"):
            parser.add_argument(
                "--allow_untrained", action=ActionYesNo, default=False,
                help="run without --ckpt_path, on untrained (randomly initialised) weights",
            )  # fmt: skip
        if subcommand == "predict":
            parser.add_argument(
                "--overwrite", action=ActionYesNo, default=False,
                help="replace an existing predictions file (never an input)",
            )  # fmt: skip
        if subcommand in ("validate", "test"):
            # the run's own table (RunSummary, metrics.md) replaces Lightning's 100-row print
            parser.set_defaults(verbose=False)
        return parser

    def before_instantiate_classes(self) -> None:
        from bft_lightning.utils.lightning_errors import check_trainer_options

        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        backbone = config.get("model.init_args.backbone")
        if isinstance(backbone, Namespace):  # flat filter flags over the config's `filter:`
            from bft_lightning.cli_overrides import stated_backbone_flags

            stated = stated_backbone_flags(getattr(self, "_argv", []))
            fold_flat_filter_options(backbone.get("init_args"), stated)
        check_launch(config)
        check_trainer_options(config.get("trainer"))

    def _trainer_config(self) -> Any:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        return config.get("trainer") or {}

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; Lightning's configuration errors become one line naming the option."""
        from bft_lightning.utils.lightning_errors import is_configuration_error, translate

        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            clear = translate(err, self._trainer_config()) if is_configuration_error(err) else None
            if clear is None:
                raise
            raise clear from err

    def parse_arguments(self, parser: Any, args: Any) -> None:
        from bft_lightning.utils.config_files import check_config_files

        saved = sys.argv
        self._argv = list(sys.argv[1:] if args is None else args)
        try:
            check_config_files(self._argv)
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"error: {err}") from None
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
        self._allow_other_data()

    def _parse_ckpt_path(self) -> None:
        """Apply the checkpoint's hyperparameters, then what the user stated over them
        (:mod:`bft_lightning.cli_overrides`): explicit options win; options that would
        invalidate the weights are refused."""
        from bft_lightning.cli_overrides import (
            explicit_model_options,
            keep_explicit,
            recorded_options,
            stated_backbone_flags,
        )
        from bft_lightning.utils.checkpoint_format import read_record

        subcommand = self.config.get("subcommand")
        path = self._ckpt_path()
        model = self.config[subcommand].get("model") if subcommand else None
        if path is None or model is None:
            super()._parse_ckpt_path()
            return
        before = model.clone()
        super()._parse_ckpt_path()
        explicit = explicit_model_options(getattr(self, "_argv", []))
        checkpoint = getattr(self, "_checkpoint", None)
        recorded = recorded_options(read_record(checkpoint) if checkpoint else None)
        flags = stated_backbone_flags(getattr(self, "_argv", []))
        keep_explicit(before, self.config[subcommand]["model"], explicit, path, recorded, flags)

    def _allow_other_data(self) -> None:
        """``--allow_other_data`` reaches the data module (``allow_other_data``)."""
        subcommand = self.config.get("subcommand")
        if not subcommand or not self.config[subcommand].get("allow_other_data"):
            return
        init = (self.config[subcommand].get("data") or {}).get("init_args")
        if init is not None and "allow_other_data" in init:
            init["allow_other_data"] = True

    def _refuse_untrained(self) -> None:
        """``validate``/``test``/``predict`` need trained weights, or ``--allow_untrained``."""
        config = self.config[self.subcommand] if self.subcommand else {}
        if config.get("ckpt_path") is None and not config.get("allow_untrained"):
            raise SystemExit(
                f"error: {self.subcommand} without --ckpt_path would run on untrained (randomly "
                "initialised) weights: pass --ckpt_path last|best|PATH, or --allow_untrained "
                "to run on them anyway"
            )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        from bft_lightning.callbacks.summary import RunSummary, without_unmeasured_flops
        from bft_lightning.utils.lightning_errors import is_configuration_error, translate

        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (TypeError, ValueError, RuntimeError, Exception) as err:
            configuration = is_configuration_error(err) or isinstance(err, TypeError)
            clear = translate(err, self._trainer_config()) if configuration else None
            if clear is None:
                raise
            raise clear from err
        check_world_size(trainer)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, RunSummary) for c in callbacks):
            callbacks.append(RunSummary())
        without_unmeasured_flops(trainer)
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
        from bft_lightning.utils.checkpoint_format import read_record

        record = read_record(checkpoint) if checkpoint else None
        vocabulary = None if record is None else record.vocabulary
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
        checkpoint, cap = getattr(self, "_checkpoint", None), self.trainer.max_epochs
        epoch = (checkpoint or {}).get("epoch")
        if isinstance(epoch, int) and cap not in (None, -1) and epoch > cap:  # as Lightning
            raise SystemExit(
                f"error: --trainer.max_epochs={cap}: the checkpoint {self._ckpt_path()} was "
                f"saved at epoch {epoch}, beyond it; raise --trainer.max_epochs to train on"
            )

    def before_validate(self) -> None:
        self._refuse_untrained()
        self._check_checkpoint()

    def before_test(self) -> None:
        self._refuse_untrained()
        self._check_checkpoint()

    def before_predict(self) -> None:
        self._refuse_untrained()
        self._check_checkpoint()
        from bft_lightning.serving import RecommendationWriter

        callbacks = getattr(self.trainer, "callbacks")  # noqa: B009 - not in Trainer's stubs
        if hasattr(self.model, "predict_k") and not any(
            isinstance(c, RecommendationWriter) for c in callbacks
        ):  # the recommendations go to a file (predictions.csv in the log folder)
            callbacks.append(RecommendationWriter())
        config = self.config["predict"]
        for writer in callbacks:
            if isinstance(writer, RecommendationWriter):
                writer.overwrite = writer.overwrite or bool(config.get("overwrite"))
                writer.protect(self._inputs())
                writer.check(self.trainer)
        config = self.config_init.get("predict", {})
        if hasattr(self.model, "predict_k") and config.get("return_predictions") is None:
            config["return_predictions"] = False  # written by the writer, not kept in memory

    def _inputs(self) -> list[str]:
        """The files this run reads (checkpoint, config files, data files): never outputs."""
        files = [a.partition("=")[2] or b for a, b in zip(self._argv, [*self._argv[1:], ""])
                 if a.partition("=")[0] in ("--config", "-c")]  # fmt: skip
        files.append(str(self.config[self.subcommand].get("ckpt_path") or ""))
        from bft_lightning.serving.writer import data_files

        return [f for f in files if f] + data_files(self.datamodule)


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


class _LeadFormatter(DefaultHelpFormatter):
    """Keeps the line breaks of the description (the options that matter most)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def main(
    args: list[str] | None = None,
    run: bool = True,
    *,
    exit_on_error: bool = True,
    cli_class: type[BFTCLI] = BFTCLI,
) -> Any:
    """The CLI; ``args`` replaces ``sys.argv[1:]`` (for tests). Errors propagate.

    ``exit_on_error=False`` makes a parse error raise (jsonargparse's
    ``ArgumentError``) instead of printing the usage and exiting; :func:`entry`
    uses it to print one line instead. ``cli_class``: a subclass of
    :class:`BFTCLI` (``tune`` runs each trial's ``fit`` through one that adds its
    pruning callbacks, so a trial is built exactly as ``fit`` builds a run).

    ``recommend`` runs :mod:`bft_lightning.serving.cli`, ``calibrate``
    :mod:`bft_lightning.serving.calibrate_cli`, ``tune``
    :mod:`bft_lightning.tuning.cli`, ``serve`` and ``export``
    :mod:`~bft_lightning.serving.serve_cli` and :mod:`~bft_lightning.serving.export_cli`;
    each exits with its status.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "tune":
        from bft_lightning.tuning.cli import main as tune

        raise SystemExit(tune(argv[1:]))
    if argv and argv[0] == "recommend":
        from bft_lightning.serving.cli import main as recommend

        raise SystemExit(recommend(argv[1:]))
    if argv and argv[0] == "calibrate":
        from bft_lightning.serving.calibrate_cli import main as calibrate

        raise SystemExit(calibrate(argv[1:], build_data=build_datamodule))
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
    return cli_class(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=parser_kwargs,
        args=args,
        run=run,
    )


def build_datamodule(config: str, overrides: list[str]) -> Any:
    """The data module a config builds (nothing run, nothing written): what ``calibrate
    --config`` hands to serving."""
    cli = main(["--config", config, "--trainer.logger=false",
                "--trainer.enable_progress_bar=false", *overrides], run=False)  # fmt: skip
    return cli.datamodule


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
        if rest and rest[0] in ("recommend", "calibrate") and debug_requested(args)[0]:
            rest = [*rest, "--debug"]  # they catch their own errors unless told not to
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
