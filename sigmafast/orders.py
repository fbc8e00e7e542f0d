"""Generation / training orders and the (un)shuffling helper.

An order is a LongTensor ``(B, T)`` whose row b is a permutation of
``0..T-1``: ``order[b, t]`` is the position visited at step t.
"""

from __future__ import annotations

from typing import Optional

import torch

ORDER_NAMES = ("left-to-right", "random", "fractal", "curriculum")


def _check_size(name: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")


def _check_sizes(batch_size, seq_len) -> None:
    _check_size("batch_size", batch_size)
    _check_size("seq_len", seq_len)


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def left_to_right(batch_size: int, seq_len: int, device=None) -> torch.Tensor:
    """(B, T) identity orders."""
    _check_sizes(batch_size, seq_len)
    return torch.arange(seq_len, device=device).expand(batch_size, seq_len).clone()


def random(
    batch_size: int, seq_len: int, generator: Optional[torch.Generator] = None, device=None
) -> torch.Tensor:
    """(B, T) independent uniformly random permutations."""
    _check_sizes(batch_size, seq_len)
    _check_generator(generator)
    dev = generator.device if generator is not None else device
    keys = torch.rand(batch_size, seq_len, generator=generator, device=dev)
    return keys.argsort(dim=-1).to(device if device is not None else dev)


def fractal_order(seq_len: int) -> list[int]:
    """Breadth-first binary-search-tree order of ``range(seq_len)``.

    Visit the middle ``(lo + hi) // 2`` of ``[0, T)``, then the middles of the
    left and right halves, level by level, left before right.
    """
    _check_size("seq_len", seq_len)
    out: list[int] = []
    level = [(0, seq_len)]
    while level:
        nxt = []
        for lo, hi in level:
            if lo >= hi:
                continue
            mid = (lo + hi) // 2
            out.append(mid)
            nxt += [(lo, mid), (mid + 1, hi)]
        level = nxt
    return out


def fractal(batch_size: int, seq_len: int, device=None) -> torch.Tensor:
    """(B, T) copies of :func:`fractal_order`."""
    _check_sizes(batch_size, seq_len)
    row = torch.tensor(fractal_order(seq_len), dtype=torch.long, device=device)
    return row.expand(batch_size, seq_len).clone()


def known_first(known: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(B, T) orders visiting the known positions first, then the unknown ones.

    Both groups are in uniformly random order. ``known`` is a (B, T) bool mask.
    """
    if not isinstance(known, torch.Tensor) or known.dtype != torch.bool or known.dim() != 2:
        raise ValueError("known must be a (B, T) bool tensor")
    _check_generator(generator)
    dev = generator.device if generator is not None else known.device
    keys = torch.rand(known.shape, generator=generator, device=dev).to(known.device)
    keys = keys + (~known).to(keys.dtype)  # known in [0, 1), unknown in [1, 2)
    return keys.argsort(dim=-1)


def curriculum_fraction(step: int, max_steps: int, start: float) -> float:
    """Left-to-right fraction of a batch: linear from ``start`` at step 0 to 0 at ``max_steps``."""
    if not 0.0 <= start <= 1.0:
        raise ValueError(f"curriculum start fraction must be in [0, 1], got {start}")
    if max_steps <= 0:
        return 0.0
    return start * max(0.0, 1.0 - step / max_steps)


def curriculum(
    batch_size: int,
    seq_len: int,
    fraction: float,
    generator: Optional[torch.Generator] = None,
    device=None,
) -> torch.Tensor:
    """(B, T) orders: the first ``floor(fraction * B + u)`` rows left-to-right, ``u ~ U[0, 1)`` drawn from
    ``generator`` after the random orders (stochastic rounding: the expected count is ``fraction * B``, so a
    batch of one row still follows the schedule on average), the rest random. No host sync."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    orders = random(batch_size, seq_len, generator=generator, device=device)
    dev = generator.device if generator is not None else orders.device
    u = torch.rand((), generator=generator, device=dev).to(orders.device)
    l2r = torch.arange(1, batch_size + 1, device=orders.device) <= fraction * batch_size + u  # (B,) floor() rows
    return torch.where(l2r[:, None], torch.arange(seq_len, device=orders.device), orders)


def make_orders(
    name: str,
    batch_size: int,
    seq_len: int,
    generator: Optional[torch.Generator] = None,
    device=None,
    fraction: float = 0.0,
) -> torch.Tensor:
    """Orders by name, one of :data:`ORDER_NAMES`; ``fraction`` is the curriculum's l2r share."""
    _check_generator(generator)
    if name == "left-to-right":
        return left_to_right(batch_size, seq_len, device=device)
    if name == "random":
        return random(batch_size, seq_len, generator=generator, device=device)
    if name == "fractal":
        return fractal(batch_size, seq_len, device=device)
    if name == "curriculum":
        return curriculum(batch_size, seq_len, fraction, generator=generator, device=device)
    raise ValueError(f"unknown order {name!r}; expected one of {ORDER_NAMES}")


def shuffle(
    x: torch.Tensor, order: torch.Tensor, bos: int, start_pos: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T) natural-order tokens and an order -> model inputs.

    Returns ``tokens [BOS, x_σ1 … x_σ(T-1)]``, ``in_pos [START, σ1 … σ(T-1)]``,
    ``out_pos [σ1 … σT]`` and ``targets [x_σ1 … x_σT]``, each (B, T): all four
    are (B, 0) when T = 0 (nothing to predict, so no BOS input either).
    ``x`` is an integer tensor of token ids and ``order`` (B, T) int64 with
    permutation rows (not checked: that would read the device).
    """
    _check_shuffle_inputs(x, order)
    _check_size("bos", bos)
    _check_size("start_pos", start_pos)
    B, T = x.shape
    targets = x.gather(1, order)  # (B, T)
    first = min(T, 1)  # the BOS input, none when there is nothing to predict
    first_tok = torch.full((B, first), bos, dtype=x.dtype, device=x.device)
    first_pos = torch.full((B, first), start_pos, dtype=order.dtype, device=order.device)
    tokens = torch.cat([first_tok, targets[:, :-1]], dim=1)
    in_pos = torch.cat([first_pos, order[:, :-1]], dim=1)
    return tokens, in_pos, order, targets


def _check_shuffle_inputs(x, order) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(order, torch.Tensor):
        raise TypeError(f"x and order must be torch.Tensors, got {type(x).__name__} and {type(order).__name__}")
    if x.dim() != 2 or x.shape != order.shape:
        raise ValueError(f"x and order must both be (B, T), got {tuple(x.shape)} and {tuple(order.shape)}")
    if order.dtype != torch.int64:
        raise ValueError(f"order must be a (B, T) int64 tensor, got {order.dtype}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"x must be an integer tensor of token ids, got {x.dtype}")


def unshuffle(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of the gather in :func:`shuffle`: ``out[b, order[b, t]] = values[b, t]``.

    ``values`` is (B, T, ...) in visiting order and ``order`` (B, T) int64 with permutation rows (not
    checked: that would read the device); returns natural order.
    """
    if not isinstance(values, torch.Tensor) or not isinstance(order, torch.Tensor):
        raise TypeError(f"values and order must be torch.Tensors, got {type(values).__name__} and "
                        f"{type(order).__name__}")
    if order.dim() != 2 or order.dtype != torch.int64 or values.dim() < 2 or values.shape[:2] != order.shape:
        raise ValueError(f"order must be a (B, T) int64 tensor and values (B, T, ...), got order {order.dtype} "
                         f"{tuple(order.shape)} and values {tuple(values.shape)}")
    index = order
    if values.dim() > 2:
        index = order.view(*order.shape, *([1] * (values.dim() - 2))).expand_as(values)
    return torch.empty_like(values).scatter_(1, index, values)
