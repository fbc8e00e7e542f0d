"""Sample from a trained σ-GPT checkpoint: ``python scripts/sample.py --checkpoint out/ckpt.pt``.

Every flag is a field of :class:`SampleArgs`. Three modes:

- unconditional (default): ``--max-new-tokens`` tokens (the task's length by default);
- ``--prompt TEXT``: the text, tokenised by the checkpoint's task, then new tokens;
- ``--infill TEMPLATE``: each ``_`` is one unknown token. For text tasks the text
  between underscores is tokenised as it stands, spaces included: with GPT-2's
  BPE a word carries its leading space, so write ``"The___ sat on the mat"``
  (three unknown tokens, then " sat"), not ``"The _ _ _ sat"``, whose spaces
  would be tokens of their own; with the char task one ``_`` is one character.
  For the other tasks the template is whitespace-separated token ids and ``_``
  (``"3 _ _ 7"``), or, without spaces, one token per character (``"01__1"``) when
  every data id is one digit (step, product, maze); for the others ``"421"``
  is the one id 421. On value tasks (``series``, ``vertical_rate``) the ids are
  bins (and, for ``vertical_rate``, an aircraft type first: the ids after the
  altitude bins, 421 to 424 with the task's defaults, for heavy jet, medium jet,
  turboprop and piston), not values: the printed samples are values, the bins' centres.
  A template shorter than ``--length`` (the task's length by default) is padded
  with unknown positions.

A checkpoint trained with ``--objective diffusion`` samples with
:func:`sigmafast.diffusion.generate` in ``--steps`` steps (``--temperature``,
``--top-k``, ``--seed`` apply; the σ-GPT strategy flags are refused).

``--live`` redraws the canvas after every iteration (burst) or token
(autoregressive) with the iteration count.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Optional

import torch

import sigmafast
from sigmafast.checkpoint import check_device
from sigmafast.request import ACCEPTANCE_RULES, AR_ORDERS, STRATEGIES, check_seed

UNKNOWN = "_"


@dataclass
class SampleArgs:
    checkpoint: str = field(default="", metadata={"help": "path of a checkpoint written by scripts/train.py"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    num_samples: int = field(default=1, metadata={"help": "rows sampled in one batch"})
    prompt: Optional[str] = field(default=None, metadata={"help": "text prompt (text tasks)"})
    infill: Optional[str] = field(default=None, metadata={
        "help": "infilling template, '_' = unknown token; for tasks other than text ones, token ids (value tasks: "
                "bin ids, not values)"})
    length: Optional[int] = field(default=None, metadata={"help": "infilling canvas length (task length)"})
    max_new_tokens: Optional[int] = field(default=None, metadata={"help": "new tokens (task length - prompt)"})
    strategy: str = field(default="burst", metadata={"choices": STRATEGIES, "help": "sampling strategy"})
    order: str = field(default="random", metadata={"choices": AR_ORDERS, "help": "autoregressive order"})
    num_orders: Optional[int] = field(default=None, metadata={"help": "orders per burst (1 lossless, 5 paper)"})
    acceptance: str = field(default="lossless", metadata={"choices": ACCEPTANCE_RULES,
                                                          "help": "burst rule: lossless (exact) or paper (opt-in)"})
    temperature: float = field(default=1.0, metadata={"help": "0 is greedy"})
    top_k: Optional[int] = field(default=None, metadata={"help": "keep the k most likely tokens"})
    seed: int = field(default=0, metadata={"help": "seed of the sampling generator"})
    live: bool = field(default=False, metadata={"help": "redraw the canvas after every iteration"})
    steps: Optional[int] = field(default=None, metadata={"help": "diffusion checkpoints: steps (canvas length)"})

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("--checkpoint is required")
        if self.prompt is not None and self.infill is not None:
            raise ValueError("pass at most one of --prompt and --infill")
        if self.num_orders is None:
            self.num_orders = 1 if self.acceptance == "lossless" else 5
        if self.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {self.num_samples}")
        check_seed("--seed", self.seed)
        if self.length is not None and self.infill is None:
            raise ValueError("--length is the canvas length of --infill: pass --infill, or --max-new-tokens instead")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.max_new_tokens is not None and self.infill is not None:
            raise ValueError("--max-new-tokens is for --prompt and unconditional sampling: with --infill the "
                             "template's '_' positions and --length set what is generated")
        if self.length is not None and self.length < 1:
            raise ValueError(f"--length must be >= 1, got {self.length}")
        check_device(self.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(SampleArgs)
    for f in dataclasses.fields(SampleArgs):
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        base = args[0] if args else hints[f.name]
        kwargs = {"default": f.default, "help": f.metadata.get("help", "")}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = base
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    return parser


def _is_text(task) -> bool:
    try:
        task.encode("")  # any string a text task's vocabulary holds, whatever its characters
    except NotImplementedError:
        return False
    return True


def parse_template(template: str, task, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) tokens and (T,) known mask of an infilling template (see the module docstring)."""
    tokens: list[int] = []
    known: list[bool] = []
    if _is_text(task):
        pieces = template.split(UNKNOWN)
        for i, piece in enumerate(pieces):
            ids = task.encode(piece) if piece else []
            tokens += ids
            known += [True] * len(ids)
            if i < len(pieces) - 1:
                tokens.append(0)
                known.append(False)
    else:
        one_digit_ids = task.vocab_size <= 11  # ids 0..9 and BOS: a template without spaces is one per character
        items = template.split() if " " in template.strip() or not one_digit_ids else list(template.strip())
        for item in items:
            if item == UNKNOWN:
                tokens.append(0)
                known.append(False)
            elif item.isdecimal():  # not isdigit(): superscripts and circled digits are digits that int() refuses
                if int(item) >= task.vocab_size or int(item) == task.bos:
                    raise ValueError(f"infill template ids must be the task's data tokens: in [0, {task.vocab_size}) "
                                     f"but not BOS ({task.bos}), got {item}")
                tokens.append(int(item))
                known.append(True)
            else:
                raise ValueError(f"infill template items must be token ids or '{UNKNOWN}', got {item!r}")
    if len(tokens) > length:
        raise ValueError(f"the template has {len(tokens)} tokens, more than the canvas length {length}")
    pad = length - len(tokens)
    return torch.tensor(tokens + [0] * pad, dtype=torch.long), torch.tensor(known + [False] * pad)


def render(task, canvas: torch.Tensor, known: torch.Tensor) -> str:
    """One row with unknown positions shown as '_' (a fixed layout decodes whole, its unknown cells as an
    out-of-vocabulary id, which the maze shows as '?')."""
    if task.fixed_length:
        return task.decode(torch.where(known, canvas, -1))
    if _is_text(task):
        return "".join(task.decode([int(t)]) if k else UNKNOWN for t, k in zip(canvas.tolist(), known.tolist()))
    return " ".join(task.token_text(int(t)) if k else UNKNOWN for t, k in zip(canvas.tolist(), known.tolist()))


class LiveView:
    """Terminal redraw of the canvas after each iteration."""

    def __init__(self, task, stream=sys.stdout) -> None:
        self.task = task
        self.stream = stream
        self.iteration = 0
        self.tty = stream.isatty()

    def __call__(self, canvas: torch.Tensor, known: torch.Tensor) -> None:
        self.iteration += 1
        canvas, known = canvas.cpu(), known.cpu()
        lines = [f"iteration {self.iteration}: {int(known.sum())}/{known.numel()} positions known (all rows)"]
        lines += [render(self.task, c, k) for c, k in zip(canvas, known)]
        prefix = "\x1b[2J\x1b[H" if self.tty else ""
        self.stream.write(prefix + "\n".join(lines) + "\n\n")
        self.stream.flush()


SAMPLER_ARGUMENTS = ("acceptance", "max_new_tokens", "num_orders", "order", "strategy", "temperature", "top_k")


def as_flags(message: str) -> str:
    """A sampler's error in this script's words: its arguments as flags (``num_orders=1`` as ``--num-orders 1``,
    ``top_k`` as ``--top-k``; ``order`` only with a value, being a word of the messages too), and the rows of
    ``idx`` as ``--num-samples``."""
    names = "|".join(SAMPLER_ARGUMENTS)
    message = re.sub(rf"\b({names})=('?)([^',\s)]*)\2", lambda m: f"--{m[1].replace('_', '-')} {m[3]}", message)
    words = "|".join(n for n in SAMPLER_ARGUMENTS if n != "order")
    message = re.sub(rf"(?<!-)\b({words})\b", lambda m: "--" + m[1].replace("_", "-"), message)
    return message.replace("the batch (the rows of idx)", "--num-samples")


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return run(SampleArgs(**vars(build_parser().parse_args(argv))))
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {as_flags(str(e))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (``sample.py --live | head``): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 1


def run(args: SampleArgs) -> int:
    from sigmafast.train import load_checkpoint

    model, task, _ = load_checkpoint(args.checkpoint, device=args.device)
    B, T = args.num_samples, task.seq_len
    kwargs: dict = {}
    if args.infill is not None:
        if task.fixed_length and args.length not in (None, T):
            raise ValueError(f"task {task.name!r} has a fixed layout of {T} tokens: --length must be {T} or left out")
        tokens, known = parse_template(args.infill, task, T if args.length is None else args.length)
        idx = tokens.expand(B, -1).to(args.device)
        kwargs["known"] = known.expand(B, -1).to(args.device)
    else:
        prompt = task.encode(args.prompt) if args.prompt is not None else []
        if args.max_new_tokens is None and len(prompt) > T:
            raise ValueError(f"--prompt is {len(prompt)} tokens long, longer than the model's sequence length "
                             f"({T} tokens): shorten it")
        idx = torch.tensor(prompt, dtype=torch.long).expand(B, len(prompt)).to(args.device)
        kwargs["max_new_tokens"] = args.max_new_tokens if args.max_new_tokens is not None else T - len(prompt)
        if task.fixed_length and len(prompt) + kwargs["max_new_tokens"] != T:
            raise ValueError(f"task {task.name!r} has a fixed layout of {T} tokens: --max-new-tokens must be "
                             f"{T - len(prompt)} or left out")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    if sigmafast.diffusion.objective_of(model) == "diffusion":
        if args.live:
            raise ValueError("--live is not available for diffusion checkpoints")
        sigma_flags = [flag for flag, value, default in (("--strategy", args.strategy, "burst"),
                                                          ("--order", args.order, "random"),
                                                          ("--acceptance", args.acceptance, "lossless"),
                                                          ("--num-orders", args.num_orders, 1)) if value != default]
        if sigma_flags:
            raise ValueError(f"{', '.join(sigma_flags)}: σ-GPT sampling flags, and this checkpoint holds a diffusion "
                             f"model (it samples in --steps steps): leave them out")
        out, stats = sigmafast.diffusion.generate(model, idx, steps=args.steps, temperature=args.temperature,
                                                  top_k=args.top_k, generator=generator, return_stats=True, **kwargs)
        return report(task, out, stats)
    if args.steps is not None:
        raise ValueError("--steps is for diffusion checkpoints; this one holds a σ-GPT")
    out, stats = sigmafast.generate(
        model, idx, temperature=args.temperature, top_k=args.top_k, strategy=args.strategy, order=args.order,
        num_orders=args.num_orders, acceptance=args.acceptance, generator=generator, return_stats=True,
        on_iteration=LiveView(task) if args.live else None, **kwargs,
    )
    return report(task, out, stats)


def report(task, out: torch.Tensor, stats) -> int:
    for row in out.cpu():
        print(task.decode(row))
        print("-" * 40)
    print(f"iterations per row: {stats.iterations.tolist()} (mean {stats.mean_iterations:.2f}), "
          f"forward calls: {stats.forward_calls}, wall time: {stats.wall_time:.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
