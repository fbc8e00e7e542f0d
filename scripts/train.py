"""Train a σ-GPT: ``python scripts/train.py --task permutation --preset tiny --max-iters 300``.

Every flag is a field of :class:`sigmafast.train.TrainConfig` (``--max-iters`` is
``max_iters``); with ``--resume`` every flag left out takes the checkpoint's value. Without it, an
``--out-dir`` that holds a checkpoint is an error (``--overwrite`` starts a new run there). Under
``torchrun --nproc_per_node=N`` the same command trains with DistributedDataParallel.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import signal
import sys
import typing

from sigmafast.train import TrainConfig, train


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """One kebab-case flag per :class:`TrainConfig` field. A flag left out is absent from the parsed namespace
    (``TrainConfig`` gives it the field's default), so that ``--resume`` knows which flags the user gave
    (:meth:`TrainConfig.explicit_fields`); ``None`` defaults mean the preset's value."""
    parser = _Parser(description=__doc__.splitlines()[0], argument_default=argparse.SUPPRESS)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        annotation = hints[f.name]
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        base = args[0] if args else annotation
        help_text = f.metadata.get("help", "")
        if f.default is not None:
            help_text += f" (default: {f.default})"
        kwargs = {"help": help_text}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = base
            kwargs["metavar"] = base.__name__.upper()
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
            kwargs.pop("metavar", None)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kwargs)
    return parser


def as_flags(message: str) -> str:
    """A config error in the words of the command line: ``TrainConfig.max_iters`` becomes ``--max-iters``."""
    return re.sub(r"\bTrainConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)


def main(argv: typing.Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = train(TrainConfig(**vars(args)))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {as_flags(str(e))}", file=sys.stderr)
        return 2
    except (FloatingPointError, OSError) as e:  # diverged, or a checkpoint write failed (the last one is intact)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second SIGINT: the trainer logged that it exits without a checkpoint
        return 128 + signal.SIGINT
    if not result.interrupted:
        return 0
    return 128 + (signal.SIGINT if result.stop_signal is None else result.stop_signal)  # the shell's convention


if __name__ == "__main__":
    sys.exit(main())
