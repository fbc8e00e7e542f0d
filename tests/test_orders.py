import itertools
import math
from collections import deque

import pytest
import torch
from helpers import P_FAIL, chi2_pvalue

from sigmafast import orders


def bfs_fractal(n: int) -> list[int]:
    """The paper's rule written independently: a FIFO queue of half-open intervals."""
    out, queue = [], deque([(0, n)])
    while queue:
        lo, hi = queue.popleft()
        if hi <= lo:
            continue
        mid = (lo + hi) // 2
        out.append(mid)
        queue.append((lo, mid))
        queue.append((mid + 1, hi))
    return out


def is_permutation_rows(o: torch.Tensor) -> bool:
    T = o.shape[1]
    return bool((o.sort(dim=1).values == torch.arange(T)).all())


@pytest.mark.parametrize("name", orders.ORDER_NAMES)
@pytest.mark.parametrize("B,T", [(1, 1), (3, 7), (5, 100)], ids=["1x1", "3x7", "5x100"])
def test_make_orders_are_permutations(name, B, T):
    g = torch.Generator().manual_seed(0)
    o = orders.make_orders(name, B, T, generator=g, fraction=0.4)
    assert o.shape == (B, T) and o.dtype == torch.long
    assert is_permutation_rows(o)


def test_random_orders_depend_on_generator_and_rows_differ():
    a = orders.random(4, 50, generator=torch.Generator().manual_seed(1))
    b = orders.random(4, 50, generator=torch.Generator().manual_seed(1))
    c = orders.random(4, 50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a[0], a[1])


def test_unknown_order_name():
    with pytest.raises(ValueError, match="unknown order 'zigzag'"):
        orders.make_orders("zigzag", 2, 5)


def test_fractal_seven():
    assert orders.fractal_order(7) == [3, 1, 5, 0, 2, 4, 6]


@pytest.mark.parametrize("n", [1, 2, 3, 8, 31, 100], ids=lambda n: f"T{n}")
def test_fractal_matches_queue_bfs(n):
    assert orders.fractal_order(n) == bfs_fractal(n)
    assert torch.equal(orders.fractal(2, n)[1], torch.tensor(bfs_fractal(n)))


def _permutation_counts(o: torch.Tensor) -> torch.Tensor:
    """How often each of the T! permutations (in ``itertools.permutations`` order) is a row of ``o``."""
    T = o.shape[1]
    index = {p: i for i, p in enumerate(itertools.permutations(range(T)))}
    return torch.bincount(torch.tensor([index[tuple(r)] for r in o.tolist()]), minlength=len(index))


def test_random_orders_are_uniform_permutations():
    """24000 random orders of 4 positions against the uniform law of the 24 permutations (chi-square), and
    known_first's known positions {0, 2} then unknown {1, 3}: each group in uniform order (4 outcomes)."""
    N = 24000
    o = orders.random(N, 4, generator=torch.Generator().manual_seed(3))
    assert chi2_pvalue(_permutation_counts(o), torch.full((24,), 1 / 24, dtype=torch.float64)) > P_FAIL
    known = torch.tensor([True, False, True, False]).expand(N, 4)
    o = orders.known_first(known, generator=torch.Generator().manual_seed(4))
    assert known.gather(1, o)[:, :2].all()
    code = (o[:, 0] == 2).long() * 2 + (o[:, 2] == 3).long()
    assert chi2_pvalue(torch.bincount(code, minlength=4), torch.full((4,), 0.25, dtype=torch.float64)) > P_FAIL


def test_left_to_right_is_identity():
    assert torch.equal(orders.left_to_right(3, 6), torch.arange(6).expand(3, 6))


def test_known_first_puts_known_first_in_random_order():
    g = torch.Generator().manual_seed(0)
    known = torch.rand(6, 40, generator=g) < 0.3
    known[0] = False
    known[1] = True
    o = orders.known_first(known, generator=g)
    assert is_permutation_rows(o)
    visited_known = known.gather(1, o)  # (B, T): is the t-th visited position known
    n_known = known.sum(dim=1, keepdim=True)
    step = torch.arange(40)
    assert torch.equal(visited_known, step < n_known)
    other = orders.known_first(known, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(o, other)


def test_known_first_rejects_non_bool():
    with pytest.raises(ValueError, match="known"):
        orders.known_first(torch.zeros(2, 3, dtype=torch.long))


def test_curriculum_fraction_is_linear():
    N, start = 40, 0.5
    fr = torch.tensor([orders.curriculum_fraction(s, N, start) for s in range(N + 1)], dtype=torch.float64)
    assert fr[0] == start and fr[-1] == 0.0
    steps = fr[1:] - fr[:-1]
    assert torch.allclose(steps, torch.full_like(steps, -start / N), atol=1e-12)
    assert orders.curriculum_fraction(N + 10, N, start) == 0.0


def test_curriculum_fraction_rejects_bad_start():
    with pytest.raises(ValueError, match="curriculum start"):
        orders.curriculum_fraction(0, 10, 1.5)


def test_curriculum_rows():
    g = torch.Generator().manual_seed(0)
    o = orders.curriculum(10, 30, 0.3, generator=g)
    l2r = (o == torch.arange(30)).all(dim=1)
    assert l2r[:3].all() and not l2r[3:].any()


@pytest.mark.parametrize("batch_size", [1, 3])
def test_curriculum_share_follows_the_schedule_at_any_batch_size(batch_size):
    """Rounding fraction * B per batch would give a batch of one no left-to-right row at fraction 0.5 (and B = 3
    a share of 0.22 against 0.25 over this schedule): the expected count is fraction * B."""
    g = torch.Generator().manual_seed(0)
    steps = 2000
    fractions = [orders.curriculum_fraction(s, steps, 0.5) for s in range(steps)]
    l2r = [(orders.curriculum(batch_size, 6, f, generator=g) == torch.arange(6)).all(dim=1).float().mean().item()
           for f in fractions]
    p_id = 1 / math.factorial(6)  # a random row that happens to be left-to-right
    expected = sum(f + (1 - f) * p_id for f in fractions) / steps  # about 0.25
    frac = [batch_size * f % 1 for f in fractions]  # the count is floor(B f) or floor(B f) + 1
    var = sum(r * (1 - r) / batch_size**2 + p_id / batch_size for r in frac)
    assert abs(sum(l2r) / steps - expected) < 4 * math.sqrt(var) / steps, (sum(l2r) / steps, expected)


def test_shuffle_layout():
    x = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    order = torch.tensor([[2, 0, 3, 1], [0, 1, 2, 3]])
    bos, start = 99, 4
    tokens, in_pos, out_pos, targets = orders.shuffle(x, order, bos, start)
    assert tokens.tolist() == [[99, 12, 10, 13], [99, 20, 21, 22]]
    assert in_pos.tolist() == [[4, 2, 0, 3], [4, 0, 1, 2]]
    assert out_pos.tolist() == order.tolist()
    assert targets.tolist() == [[12, 10, 13, 11], [20, 21, 22, 23]]


def test_shuffle_unshuffle_round_trip():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 50, (5, 17), generator=g)
    order = orders.random(5, 17, generator=g)
    _, _, out_pos, targets = orders.shuffle(x, order, bos=50, start_pos=17)
    assert torch.equal(orders.unshuffle(targets, out_pos), x)
    feats = torch.randn(5, 17, 3, generator=g)
    shuffled = feats.gather(1, order[..., None].expand(5, 17, 3))
    assert torch.equal(orders.unshuffle(shuffled, order), feats)


def test_shuffle_of_the_empty_sequence_is_empty():
    """T = 0: nothing to predict, so no BOS input either; the four tensors are (B, T) as documented."""
    empty = torch.zeros(3, 0, dtype=torch.long)
    assert [tuple(t.shape) for t in orders.shuffle(empty, empty, 4, 8)] == [(3, 0)] * 4
    assert orders.fractal_order(0) == [] and orders.fractal(2, 0).shape == (2, 0)


def test_shuffle_shape_mismatch():
    with pytest.raises(ValueError, match="x and order"):
        orders.shuffle(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), 0, 4)


@pytest.mark.parametrize("call, error, match", [
    (lambda: orders.left_to_right(2.0, 5), TypeError, "batch_size must be an int"),
    (lambda: orders.random(2, -1), ValueError, "seq_len must be >= 0"),
    (lambda: orders.fractal(True, 5), TypeError, "batch_size must be an int"),
    (lambda: orders.curriculum(4, 5, 1.5), ValueError, "fraction must be a number in \\[0, 1\\]"),
    (lambda: orders.curriculum(4, 5, -0.1), ValueError, "fraction must be a number in \\[0, 1\\]"),
    (lambda: orders.unshuffle(torch.zeros(2, 5), torch.arange(4).expand(2, 4)), ValueError, "order must be a"),
    (lambda: orders.unshuffle(torch.zeros(2, 5), torch.arange(5.0).expand(2, 5)), ValueError, "int64"),
    (lambda: orders.unshuffle(torch.zeros(5), torch.arange(5)), ValueError, "order must be a"),
    (lambda: orders.unshuffle([0.0] * 5, torch.arange(5)[None]), TypeError, "values and order must be"),
    (lambda: orders.shuffle(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), 4, 8), ValueError, "int64"),
    (lambda: orders.shuffle([[0]], [[0]], 4, 8), TypeError, "x and order must be torch.Tensors"),
    (lambda: orders.shuffle(torch.zeros(1, 3), torch.arange(3)[None], 4, 8), TypeError,
     "x must be an integer tensor"),
    (lambda: orders.shuffle(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], 4.5, 8), TypeError,
     "bos must be an int"),
    (lambda: orders.shuffle(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], 4, -1), ValueError,
     "start_pos must be >= 0"),
    (lambda: orders.fractal_order(5.0), TypeError, "seq_len must be an int, got float"),
    (lambda: orders.fractal_order(-3), ValueError, "seq_len must be >= 0"),
    (lambda: orders.fractal_order("a"), TypeError, "seq_len must be an int, got str"),
    (lambda: orders.random(2, 3, generator=1), TypeError, "generator must be a torch.Generator or None, got int"),
    (lambda: orders.known_first(torch.ones(2, 3, dtype=torch.bool), generator=1), TypeError,
     "generator must be a torch.Generator or None"),
    (lambda: orders.curriculum(2, 3, 0.5, generator=1), TypeError, "generator must be a torch.Generator or None"),
    (lambda: orders.make_orders("fractal", 2, 3, generator=1), TypeError,
     "generator must be a torch.Generator or None"),
], ids=["l2r-float-batch", "random-negative-length", "fractal-bool-batch", "curriculum-over-1",
        "curriculum-negative", "unshuffle-shape", "unshuffle-float-order", "unshuffle-1d", "unshuffle-list",
        "shuffle-float-order", "shuffle-lists", "shuffle-float-tokens", "shuffle-float-bos",
        "shuffle-negative-start", "fractal-order-float", "fractal-order-negative", "fractal-order-str",
        "random-int-generator", "known-first-int-generator", "curriculum-int-generator",
        "make-orders-int-generator"])
def test_orders_reject_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
