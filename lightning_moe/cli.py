"""The ``lightning-moe`` console script: LightningCLI with our model and data as defaults.

``lightning-moe fit --config configs/tiny_moe.yaml`` (subcommands fit / validate / test /
predict). Model and data are given in class_path form, so any LightningModule or DataModule can
be named in YAML; importing this package registers the ``folded_moe`` strategy name first.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_moe  # noqa: F401 - registers the strategy names before the Trainer parses them
from lightning_moe.data import MoEDataModule
from lightning_moe.lit import MoELanguageModel

__all__ = ["MoECLI", "main"]


class MoECLI(LightningCLI):
    """LightningCLI whose defaults are :class:`MoELanguageModel` and :class:`MoEDataModule`."""

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


def main(args: list[str] | None = None) -> None:
    MoECLI(
        MoELanguageModel,
        MoEDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
