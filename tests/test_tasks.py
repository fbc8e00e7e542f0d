"""Synthetic and maze tasks: valid generators, strict validity metrics, seeding, splits, bad input."""

import math
import subprocess
import sys
from collections import deque

import pytest
import torch

from sigmafast.tasks import TASK_NAMES, get_task
from sigmafast.tasks.maze import EMPTY, GOAL, PATH, START, WALL

SYNTHETIC = ["product", "step", "permutation", "random_walk", "maze"]
CONSTRAINED = {"step": "valid", "permutation": "valid", "random_walk": "valid", "maze": "correct"}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def tasks():
    return {name: get_task(name) for name in SYNTHETIC}


@pytest.fixture(scope="module")
def maze_rows(tasks):
    return tasks["maze"].sample_batch(48, "train", gen(3))


# ---------------------------------------------------------------- registry


def test_registry_names():
    assert TASK_NAMES == ("product", "step", "permutation", "random_walk", "maze", "vertical_rate", "series", "char",
                          "owt", "wikitext103")


def test_text_tasks_are_imported_lazily():
    code = "import sys, sigmafast.tasks; print('sigmafast.tasks.text' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match="unknown task 'nope'.*permutation.*wikitext103"):
        get_task("nope")


@pytest.mark.parametrize("name", SYNTHETIC)
def test_unknown_kwarg_is_named(name):
    with pytest.raises(TypeError, match="seq_lenn"):
        get_task(name, seq_lenn=5)


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("step", dict(seq_len=9)),
        ("permutation", dict(seq_len=1)),
        ("product", dict(p_one=1.5)),
        ("random_walk", dict(seq_len=0)),
        ("maze", dict(height=12)),
        ("maze", dict(min_distance=40)),
        ("maze", dict(val_size=0)),
    ],
    ids=["step-too-short", "perm-one-class", "product-bad-p", "walk-empty", "maze-even-height",
         "maze-unreachable-distance", "maze-no-val"],
)
def test_bad_task_arguments(name, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        get_task(name, **kwargs)


def test_maze_walls_that_do_not_fit_are_an_error_not_a_hang():
    task = get_task("maze", height=5, width=5, n_walls=3, min_distance=2)
    with pytest.raises(ValueError, match=r"n_walls=3: 200 attempts failed .* in a 5x5 maze"):
        task.sample_batch(1, "train", gen(0))


# ---------------------------------------------------------------- generators


@pytest.mark.parametrize("name", SYNTHETIC)
@pytest.mark.parametrize("split", ["train", "val"])
def test_samples_are_valid(tasks, name, split):
    task = tasks[name]
    x = task.sample_batch(64, split, gen(0))
    assert x.shape == (64, task.seq_len) and x.dtype == torch.int64
    assert task.bos == task.vocab_size - 1
    assert 0 <= int(x.min()) and int(x.max()) < task.bos  # BOS never appears in data
    metrics = task.evaluate(x)
    if name == "product":
        assert set(metrics) == {"ones_rate"}
    else:
        assert metrics and all(v == 1.0 for v in metrics.values()), metrics


def test_product_ones_rate():
    task = get_task("product")
    x = task.sample_batch(512, "train", gen(1))
    n = x.numel()
    sigma = math.sqrt(0.1 * 0.9 / n)
    assert abs(task.evaluate(x)["ones_rate"] - 0.1) < 5 * sigma
    assert set(x.unique().tolist()) == {0, 1}


def test_step_offsets_cover_every_position():
    task = get_task("step")
    x = task.sample_batch(2000, "train", gen(2))
    offsets = x.argmax(dim=1)
    assert set(offsets.tolist()) == set(range(task.seq_len - task.run_length + 1))


def test_random_walk_statistics():
    task = get_task("random_walk")
    x = task.sample_batch(2000, "train", gen(4))
    starts = (x[:, 0] + task.value_offset).tolist()
    for s in (100, 120, 130, 140):
        share = starts.count(s) / len(starts)
        assert abs(share - 0.25) < 5 * math.sqrt(0.25 * 0.75 / len(starts))
    steps = x.diff(dim=1)
    for value, p in ((-1, 0.4), (1, 0.4), (0, 0.2)):
        rate = (steps == value).double().mean().item()
        assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / steps.numel())


def test_random_walk_vocab_covers_reachable_values():
    task = get_task("random_walk")
    assert task.value_offset == 0 and task.vocab_size == 241 and task.bos == 240
    long = get_task("random_walk", seq_len=150)
    assert long.value_offset == 100 - 149 and long.bos == 140 + 149 - long.value_offset + 1
    assert long.evaluate(long.sample_batch(32, "train", gen(0)))["valid"] == 1.0


@pytest.mark.parametrize(
    "name,seq_len", [("product", 7), ("step", 10), ("step", 33), ("permutation", 2), ("permutation", 17),
                     ("random_walk", 1), ("random_walk", 5)],
    ids=lambda v: str(v),
)
def test_seq_len_override(name, seq_len):
    task = get_task(name, seq_len=seq_len)
    x = task.sample_batch(16, "train", gen(0))
    assert x.shape == (16, seq_len) and int(x.max()) < task.bos
    if name == "permutation":
        assert task.n_classes == seq_len and task.vocab_size == seq_len + 1
    if name != "product":
        assert task.evaluate(x)["valid"] == 1.0


# ---------------------------------------------------------------- validity metrics reject corruption


def corrupt(task, x, positions, g, min_change=1):
    """Change x[b, positions[b]] to a different in-vocab value at least ``min_change`` away (or BOS)."""
    y = x.clone()
    for b, p in enumerate(positions.tolist()):
        old = int(y[b, p])
        choices = [v for v in range(task.vocab_size) if abs(v - old) >= min_change or v == task.bos]
        y[b, p] = choices[int(torch.randint(len(choices), (1,), generator=g))]
    assert ((y != x).sum(dim=1) == 1).all()
    return y


@pytest.mark.parametrize("name", ["step", "permutation", "random_walk", "maze"])
def test_one_changed_token_is_invalid(tasks, name):
    task = tasks[name]
    g = gen(5)
    x = task.sample_batch(64, "train", g)
    positions = torch.randint(task.seq_len, (64,), generator=g)
    # a lazy walk tolerates some +-1/+-2 edits (5 5 5 -> 5 6 5); a jump of >= 3 never fits
    y = corrupt(task, x, positions, g, min_change=3 if name == "random_walk" else 1)
    key = CONSTRAINED[name]
    per_row = [task.evaluate(y[b : b + 1])[key] for b in range(64)]
    assert per_row == [0.0] * 64
    assert task.evaluate(torch.cat([x[:1], y[:3]]))[key] == pytest.approx(0.25)


def step_row(*runs, length=100, fill=None):
    x = torch.zeros(length, dtype=torch.long)
    for start, n in runs:
        x[start : start + n] = 1
    if fill is not None:
        x[fill[0]] = fill[1]
    return x[None]


@pytest.mark.parametrize(
    "row,valid",
    [(step_row((0, 10)), 1.0), (step_row((90, 10)), 1.0), (step_row((20, 5), (40, 5)), 0.0),
     (step_row((20, 11)), 0.0), (step_row((20, 9)), 0.0), (step_row(), 0.0),
     (step_row((0, 10), fill=(50, 2)), 0.0)],
    ids=["first", "last", "two-runs-of-5", "run-of-11", "run-of-9", "all-zero", "contains-bos"],
)
def test_step_rules(tasks, row, valid):
    assert tasks["step"].evaluate(row)["valid"] == valid


def test_random_walk_rules():
    task = get_task("random_walk", seq_len=101)  # can climb from 140 to 240, just below BOS = 241
    top = torch.arange(140, 241)[None]
    assert task.bos == 241 and task.evaluate(top)["valid"] == 1.0
    cases = {"bos-at-end": (100, task.bos), "jump-of-2": (50, 192), "bad-start": (0, 139),
             "bos-start": (0, task.bos)}
    for case, (pos, value) in cases.items():
        row = top.clone()
        row[0, pos] = value
        assert task.evaluate(row)["valid"] == 0.0, case


@pytest.mark.parametrize("where", ["maze-half", "solution-non-path", "solution-path"])
def test_maze_corruption(tasks, maze_rows, where):
    task, x, g = tasks["maze"], maze_rows, gen(6)
    n = task.n_cells
    if where == "maze-half":
        allowed = torch.arange(task.seq_len) < n
    positions = []
    for row in x:
        if where == "solution-non-path":
            allowed = (torch.arange(task.seq_len) >= n) & (row != PATH)
        elif where == "solution-path":
            allowed = row == PATH
        idx = allowed.nonzero().flatten()
        positions.append(int(idx[torch.randint(idx.numel(), (1,), generator=g)]))
    y = corrupt(task, x, torch.tensor(positions), g)
    for b in range(x.shape[0]):
        assert task.evaluate(y[b : b + 1]) == {"correct": 0.0, "optimal": 0.0}


def open_maze(task, start, goal, path):
    """A wall-bordered empty maze with the given start, goal and drawn path cells."""
    grid = torch.full((task.height, task.width), EMPTY)
    grid[[0, -1], :] = WALL
    grid[:, [0, -1]] = WALL
    grid[start] = START
    grid[goal] = GOAL
    drawn = grid.clone()
    for cell in path:
        drawn[cell] = PATH
    return torch.cat([grid.flatten(), drawn.flatten()])[None]


def test_maze_detour_is_correct_not_optimal(tasks):
    task = tasks["maze"]
    start, goal = (6, 2), (6, 14)
    straight = [(6, c) for c in range(3, 14)]
    detour = [(5, 2), (4, 2)] + [(4, c) for c in range(3, 15)] + [(5, 14)]
    assert task.evaluate(open_maze(task, start, goal, straight)) == {"correct": 1.0, "optimal": 1.0}
    assert task.evaluate(open_maze(task, start, goal, detour)) == {"correct": 1.0, "optimal": 0.0}
    # a route touching itself, a broken route and a route plus a separate loop are not correct
    touching = [(6, 3), (5, 3), (5, 4), (6, 4)] + [(6, c) for c in range(5, 14)]
    broken = straight[:4] + straight[5:]
    loop = straight + [(2, 2), (2, 3), (3, 3), (3, 2)]
    for path in (touching, broken, loop):
        assert task.evaluate(open_maze(task, start, goal, path))["correct"] == 0.0


def bfs(maze, source):
    """Plain-Python BFS distances from ``source`` over non-wall cells of a (H, W) list grid."""
    h, w = len(maze), len(maze[0])
    dist = {source: 0}
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if 0 <= nr < h and 0 <= nc < w and maze[nr][nc] != WALL and (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    return dist


def test_maze_samples_are_shortest_paths(tasks, maze_rows):
    task = tasks["maze"]
    assert task.seq_len == 546 and task.prompt_mask.sum() == 273 and task.prompt_mask[:273].all()
    for row in maze_rows[:16]:
        maze = row[: task.n_cells].view(task.height, task.width).tolist()
        drawn = row[task.n_cells :].view(task.height, task.width).tolist()
        cells = {v: [(r, c) for r in range(task.height) for c in range(task.width) if maze[r][c] == v]
                 for v in (START, GOAL)}
        (s,), (goal,) = cells[START], cells[GOAL]
        assert abs(s[0] - goal[0]) + abs(s[1] - goal[1]) >= 10
        path = {(r, c) for r in range(task.height) for c in range(task.width) if drawn[r][c] == PATH}
        assert all(maze[r][c] == EMPTY for r, c in path)
        # walk from the start along path cells: every step must have a single way on
        cur, prev, seen = s, None, 0
        while cur != goal:
            (r, c) = cur
            around = ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1))
            nxt = [n for n in around if n != prev and (n in path or n == goal)]
            assert len(nxt) == 1
            prev, cur, seen = cur, nxt[0], seen + 1
        assert seen == len(path) + 1 == bfs(maze, goal)[s]


def test_maze_moves_are_uniform_among_optimal():
    task = get_task("maze", n_walls=0)  # open room: both axes are optimal until one is exhausted
    x = task.sample_batch(256, "train", gen(7))
    vertical_first = []
    for row in x:
        maze = row[: task.n_cells].view(task.height, task.width)
        drawn = row[task.n_cells :].view(task.height, task.width)
        (sr, sc), (gr, gc) = (maze == START).nonzero()[0].tolist(), (maze == GOAL).nonzero()[0].tolist()
        if sr != gr and sc != gc:
            step_r = sr + (1 if gr > sr else -1)
            vertical_first.append(int(drawn[step_r, sc]) == PATH)
    share, n = sum(vertical_first) / len(vertical_first), len(vertical_first)
    assert abs(share - 0.5) < 4 * math.sqrt(0.25 / n)


def test_maze_decode(tasks, maze_rows):
    text = tasks["maze"].decode(maze_rows[0])
    lines = text.split("\n")
    assert len(lines) == 13 and {len(line) for line in lines} == {21 + 3 + 21}
    left = "".join(line[:21] for line in lines)
    right = "".join(line[24:] for line in lines)
    assert left.count("S") == right.count("S") == 1 and "*" not in left and "*" in right and "#" in left
    with pytest.raises(ValueError, match="546"):
        tasks["maze"].decode(maze_rows[0][:100])


@pytest.mark.parametrize("name", ["product", "step", "permutation", "random_walk"])
def test_decode_1d(tasks, name):
    task = tasks[name]
    text = task.decode(task.sample_batch(1, "train", gen(0))[0])
    assert isinstance(text, str) and text and "?" not in text
    assert not task.prompt_mask.any()


# ---------------------------------------------------------------- seeding and splits


@pytest.mark.parametrize("name", SYNTHETIC)
def test_seeding_is_reproducible(tasks, name):
    task = tasks[name]
    a = task.sample_batch(32, "train", gen(11))
    assert torch.equal(a, task.sample_batch(32, "train", gen(11)))
    assert not torch.equal(a, task.sample_batch(32, "train", gen(12)))


@pytest.mark.parametrize("name", SYNTHETIC)
def test_val_split_is_fixed(tasks, name):
    task = tasks[name]
    torch.manual_seed(123)
    first = task.sample_batch(16, "val")
    torch.manual_seed(456)
    assert torch.equal(first, task.sample_batch(16, "val"))
    assert torch.equal(first, get_task(name).sample_batch(16, "val"))  # same set in a fresh instance
    picked = task.sample_batch(16, "val", gen(1))
    assert torch.equal(picked, task.sample_batch(16, "val", gen(1)))
    whole = task.sample_batch(task.val_size, "val")
    assert (picked[:, None, :] == whole[None]).all(dim=2).any(dim=1).all()  # rows of the fixed set
    if name != "step":  # only 91 distinct step sequences exist
        assert not torch.equal(first, task.sample_batch(16, "train", gen(0)))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", SYNTHETIC)
def test_bad_split_and_batch_size(tasks, name):
    with pytest.raises(ValueError, match="split"):
        tasks[name].sample_batch(4, "test")
    with pytest.raises(ValueError, match="batch_size"):
        tasks[name].sample_batch(0)
    with pytest.raises(TypeError, match="generator"):
        tasks[name].sample_batch(4, "train", generator=7)


@pytest.mark.parametrize("name", SYNTHETIC)
@pytest.mark.parametrize(
    "make",
    [lambda T: torch.zeros(T, dtype=torch.long), lambda T: torch.zeros(2, T + 1, dtype=torch.long),
     lambda T: torch.zeros(0, T, dtype=torch.long), lambda T: torch.zeros(2, T)],
    ids=["1d", "wrong-length", "empty-batch", "float"],
)
def test_evaluate_rejects_bad_input(tasks, name, make):
    with pytest.raises(ValueError, match="samples"):
        tasks[name].evaluate(make(tasks[name].seq_len))


def test_evaluate_rejects_non_tensor(tasks):
    with pytest.raises(TypeError, match="samples"):
        tasks["permutation"].evaluate([[0, 1]])


@pytest.mark.parametrize("name", ["product", "step", "permutation"])
def test_oracle_parameters(tasks, name):
    task = tasks[name]
    assert {"product": "p_one", "step": "run_length", "permutation": "n_classes"}[name] in vars(task)
    from sigmafast.tasks.oracles import make_oracle

    assert type(task.oracle()) is type(make_oracle(task))
