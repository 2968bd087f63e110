"""The ``lightning-moe`` console script: LightningCLI with our model and data as defaults.

``lightning-moe fit --config configs/tiny_moe.yaml`` (subcommands fit / validate / test /
predict). Model and data are given in class_path form, so any LightningModule or DataModule can
be named in YAML; importing this package registers the ``folded_moe`` strategy name first.

``--config`` (or ``-c``) also takes a packaged recipe by name, so an installed wheel runs them
from any directory: ``lightning-moe fit --config tiny_moe`` (``tiny_moe.yaml`` works too). An
existing file wins over a recipe of the same name; an unknown name, or a ``*.yaml`` path that is
not a file, exits with one line listing the recipes. ``lightning-moe recipes`` prints each
recipe's name and file (rules: :func:`lightning_moe.resources.resolve_recipe`).
``lightning-moe generate --checkpoint ... --prompt ...`` samples text from a trained model
(:mod:`lightning_moe.generate`).

Bad input exits before training starts with a short message on stderr instead of a parser dump or
a traceback: an unknown key or a value of the wrong type (exit status 2) gives the key path and the
parser's reason plus a pointer to ``--help``; a value that a class's constructor refuses (the
model, the data, the Trainer, its strategy or callbacks; exit status 1) gives that constructor's own
``Owner: field=value breaks rule; fix.`` line. ``--help`` and ``--print_config`` are unchanged.
"""

from __future__ import annotations

import re
import sys
from typing import Any, NoReturn

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_moe  # noqa: F401 - registers the strategy names before the Trainer parses them
from lightning_moe import resources
from lightning_moe.data import MoEDataModule
from lightning_moe.lit import MoELanguageModelBase

__all__ = ["CLIInputError", "MoECLI", "main", "print_recipes", "resolve_config_args", "short_parser_message"]

_CONFIG_FLAGS = ("-c", "--config")

# Lines of a jsonargparse error that describe its search, not the problem.
_NOISE = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value type:",
    "Given value:",
    "Expected a <class 'NoneType'>",
    "Problem with given class_path",
    "Not a valid subclass of",
    "Import path ",
)
_KEY = re.compile(r'^Parser key "([^"]+)":\s*(.*)$')
_OURS = re.compile(r"^[A-Za-z_][\w.<>-]*: \S+=")  # "Owner: field=value ..."


_INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError, MisconfigurationException)


class CLIInputError(Exception):
    """A class named in the configuration refused its arguments; the message is one line."""


def short_parser_message(message: str) -> str:
    """One line from a (multi-line) jsonargparse error: the key path and the first reason.

    A lightning-moe ``Owner: field=value ...`` line inside the message wins; otherwise the nested
    ``Parser key`` names are joined into a dotted path before the parser's own reason.
    """
    lines = [ln.strip().removeprefix("- ").strip() for ln in message.splitlines()]
    ours = [ln for ln in lines if _OURS.match(ln)]
    if ours:
        return ours[0]
    keys: list[str] = []
    for ln in lines:
        match = _KEY.match(ln)
        if match:
            keys.append(match.group(1))
            ln = match.group(2)
        if ln and not ln.startswith(_NOISE):
            return f"{'.'.join(keys)}: {ln}" if keys else ln
    return lines[0] if lines else message


def _input_message(exc: BaseException) -> str:
    """The first ``Owner: field=value ...`` line anywhere in ``exc``'s chain, else its root cause, shortened."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        chain.append(node)
        node = node.__cause__ or node.__context__
    for item in chain:
        for line in str(item).splitlines():
            line = line.strip().removeprefix("- ").strip()
            if _OURS.match(line):
                return line
    return short_parser_message(str(chain[-1]))


class _ShortErrorParser(LightningArgumentParser):
    """Parser errors as two lines (the short reason, then a pointer to ``--help``), exit status 2."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: {short_parser_message(message)}\n")
        sys.stderr.write(f"{prog}: run `{prog} --help` for the accepted keys and types.\n")
        sys.exit(2)


class MoECLI(LightningCLI):
    """LightningCLI for models deriving from :class:`MoELanguageModelBase` and :class:`MoEDataModule` data.

    A constructor that refuses its arguments (model, data, Trainer, strategy, callbacks) raises
    :class:`CLIInputError` with its one-line message; :func:`main` prints it without a traceback.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", _ShortErrorParser)
        super().__init__(*args, **kwargs)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except _INPUT_ERRORS as exc:
            raise CLIInputError(_input_message(exc)) from exc

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        try:
            return super().instantiate_trainer(**kwargs)
        except _INPUT_ERRORS as exc:
            raise CLIInputError(_input_message(exc)) from exc

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
    """Run the CLI on ``args`` (default: ``sys.argv[1:]``); ``recipes`` lists the packaged recipes,
    ``generate`` samples from a checkpoint."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["recipes"]:
        print_recipes()
        return
    if argv[:1] == ["generate"]:
        from lightning_moe.generate import main as generate_main

        generate_main(argv[1:])
        return
    try:
        argv = resolve_config_args(argv)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None  # one line on stderr, exit status 1; no traceback
    if args is None:
        # LightningCLI warns when given args besides a command line; and launchers that start
        # more ranks re-run sys.argv, which then names the resolved recipe file.
        sys.argv[1:] = argv
    try:
        MoECLI(
            MoELanguageModelBase,
            MoEDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=None if args is None else argv,
        )
    except CLIInputError as exc:
        raise SystemExit(str(exc)) from None  # one line on stderr, exit status 1


if __name__ == "__main__":
    main()
