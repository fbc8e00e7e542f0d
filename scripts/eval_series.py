"""Prompted MSE table of a value-task checkpoint: ``python scripts/eval_series.py --checkpoint out/ckpt.pt``.

For a ``vertical_rate`` or ``series`` checkpoint, prints a markdown table of the
mean ± std MSE over the whole sequence when the model is prompted with each
``--fractions`` of the ground truth and samples the rest autoregressively in
each of ``--orders`` (see :mod:`sigmafast.series_eval`). Every flag is a field
of :class:`EvalArgs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Optional

import torch

from sigmafast.request import AR_ORDERS, check_seed


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(item) for item in text.split(","))
    except ValueError:
        raise ValueError(f"--fractions must be comma-separated numbers, got {text!r}") from None


@dataclass
class EvalArgs:
    checkpoint: str = field(default="", metadata={"help": "path of a checkpoint written by scripts/train.py"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    fractions: str = field(default="0,0.1,0.5", metadata={"help": "comma-separated prompt fractions in [0, 1)"})
    orders: str = field(default=",".join(("left-to-right", "random", "fractal")),
                        metadata={"help": f"comma-separated orders among {', '.join(AR_ORDERS)}"})
    samples_per_sequence: int = field(default=20, metadata={"help": "samples per validation sequence"})
    num_sequences: int = field(default=50, metadata={"help": "validation sequences"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (0 is greedy)"})
    seed: int = field(default=0, metadata={"help": "seed of the validation draw and of sampling"})

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("--checkpoint is required")
        _floats(self.fractions)
        check_seed("--seed", self.seed)

    def fraction_list(self) -> tuple[float, ...]:
        return _floats(self.fractions)

    def order_list(self) -> tuple[str, ...]:
        return tuple(item.strip() for item in self.orders.split(","))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(EvalArgs)
    for f in dataclasses.fields(EvalArgs):
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=hints[f.name], default=f.default,
                            help=f.metadata.get("help", ""))
    return parser


def run(args: EvalArgs) -> int:
    from sigmafast.checkpoint import load_checkpoint
    from sigmafast.series_eval import evaluate_prompted, markdown_table

    model, task, train_cfg = load_checkpoint(args.checkpoint, device=args.device)
    if train_cfg.objective == "diffusion":
        raise ValueError(f"--checkpoint {args.checkpoint} holds a diffusion model: eval_series.py samples σ-GPT "
                         f"checkpoints autoregressively in --orders, and has no diffusion mode")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    results = evaluate_prompted(model, task, args.fraction_list(), args.order_list(), args.samples_per_sequence,
                                args.num_sequences, generator, temperature=args.temperature)
    print(f"task {task.name}, trained in {train_cfg.order} order: {args.checkpoint}\n")
    print(markdown_table(results, getattr(task, "unit", "")))
    return 0


def as_flags(message: str) -> str:
    """An evaluation error in this script's words: the argument it starts with (``num_sequences must be ...``)
    as its flag (``--num-sequences must be ...``)."""
    names = "|".join(f.name for f in dataclasses.fields(EvalArgs))
    return re.sub(rf"^({names})\b", lambda m: "--" + m[1].replace("_", "-"), message)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return run(EvalArgs(**vars(build_parser().parse_args(argv))))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {as_flags(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
