"""The ``lightning-moe`` console script: LightningCLI with our model and data as defaults.

``lightning-moe fit --config configs/tiny_moe.yaml`` (subcommands fit / validate / test /
predict). Model and data are given in class_path form, so any LightningModule or DataModule can
be named in YAML; importing this package registers the ``folded_moe`` strategy name first.

``--config`` (or ``-c``) also takes a packaged recipe by name, so an installed wheel runs them
from any directory: ``lightning-moe fit --config tiny_moe`` (``tiny_moe.yaml`` works too). An
existing file wins over a recipe of the same name; an unknown name, or a ``*.yaml`` path that is
not a file, exits with one line listing the recipes. ``lightning-moe recipes`` prints each
recipe's name and file (rules: :func:`lightning_moe.resources.resolve_recipe`).
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

import lightning_moe  # noqa: F401 - registers the strategy names before the Trainer parses them
from lightning_moe import resources
from lightning_moe.data import MoEDataModule
from lightning_moe.lit import MoELanguageModelBase

__all__ = ["MoECLI", "main", "print_recipes", "resolve_config_args"]

_CONFIG_FLAGS = ("-c", "--config")


class MoECLI(LightningCLI):
    """LightningCLI for models deriving from :class:`MoELanguageModelBase` and :class:`MoEDataModule` data."""

    def after_fit(self) -> None:
        """Print the validation loss before the first step and at the end (rank zero)."""
        history = getattr(self.model, "val_history", None)
        if not history or self.trainer.global_rank != 0:
            return
        (first_step, first), (last_step, last) = history[0], history[-1]
        drop = 100.0 * (first - last) / first if first else 0.0
        print(
            f"validation loss: {first:.4f} at step {first_step} -> {last:.4f} at step {last_step} "
            f"({drop:.1f} % lower)",
            flush=True,
        )


def resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with every ``--config`` / ``-c`` value passed through
    :func:`lightning_moe.resources.resolve_recipe` (a recipe name becomes its packaged file).

    Raises ``ValueError`` for an unknown recipe name, listing the packaged ones.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":  # what follows is not ours to read
            return out + args[i:]
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            out += [arg, resources.resolve_recipe(args[i + 1])]
            i += 2
            continue
        flag, eq, value = arg.partition("=")
        out.append(f"{flag}={resources.resolve_recipe(value)}" if eq and flag in _CONFIG_FLAGS else arg)
        i += 1
    return out


def print_recipes() -> None:
    """One line per packaged recipe: its name, then its file."""
    for name in resources.recipe_names():
        print(f"{name}  {resources.recipe_path(name)}")


def main(args: list[str] | None = None) -> None:
    """Run the CLI on ``args`` (default: ``sys.argv[1:]``); ``recipes`` lists the packaged recipes."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["recipes"]:
        print_recipes()
        return
    try:
        argv = resolve_config_args(argv)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None  # one line on stderr, exit status 1; no traceback
    if args is None:
        # LightningCLI warns when given args besides a command line; and launchers that start
        # more ranks re-run sys.argv, which then names the resolved recipe file.
        sys.argv[1:] = argv
    MoECLI(
        MoELanguageModelBase,
        MoEDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=None if args is None else argv,
    )


if __name__ == "__main__":
    main()
