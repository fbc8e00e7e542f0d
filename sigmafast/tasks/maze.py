"""Maze task: draw a shortest path from start to goal in a random grid maze.

A sequence is the maze (``height * width`` cells, row-major) followed by the
same grid with the path drawn, so T = 2 * 13 * 21 = 546 by default; the maze
half is the prompt.

Generator (vectorised over the batch with numpy):

- Walls: the outer border, then ``n_walls`` straight segments on the even
  lattice. A segment is vertical or horizontal with probability 1/2, lies on a
  uniformly chosen interior even row/column, spans an even length ``2k`` cells
  plus one (``k`` uniform in ``1 .. dim // 4``, so at most about half the grid's
  extent) and starts at a uniform even offset where it fits. A proposal is
  rejected when it shares more than one cell with the walls already placed, so
  segments never close a loop and every free cell stays reachable; a maze that
  needs more than ``10 * n_walls`` proposals starts over.
- Goal: a uniformly random empty cell. Start: a uniformly random empty cell
  reachable from the goal at Manhattan distance >= ``min_distance``.
- Path: from the start, step to a neighbour whose BFS distance to the goal is
  one less, uniformly among those, until the goal. The path cells are the cells
  strictly between start and goal.
"""

from __future__ import annotations

import numpy as np
import torch

from .synthetic import SyntheticTask, check_int, token_list

EMPTY, WALL, START, GOAL, PATH = range(5)
CHARS = {EMPTY: " ", WALL: "#", START: "S", GOAL: "G", PATH: "*"}
MAX_RESTARTS = 200  # mazes started over for one row before n_walls is deemed infeasible (the default: <= 3)
_MOVES = np.array([(-1, 0), (1, 0), (0, -1), (0, 1)])


def _dilate(mask: np.ndarray) -> np.ndarray:
    """(B, H, W) bool -> cells with at least one 4-neighbour in ``mask``."""
    out = np.zeros_like(mask)
    out[:, 1:] |= mask[:, :-1]
    out[:, :-1] |= mask[:, 1:]
    out[:, :, 1:] |= mask[:, :, :-1]
    out[:, :, :-1] |= mask[:, :, 1:]
    return out


def _neighbour_count(mask: np.ndarray) -> np.ndarray:
    """(B, H, W) bool -> (B, H, W) number of 4-neighbours in ``mask``."""
    m = mask.astype(np.int64)
    out = np.zeros_like(m)
    out[:, 1:] += m[:, :-1]
    out[:, :-1] += m[:, 1:]
    out[:, :, 1:] += m[:, :, :-1]
    out[:, :, :-1] += m[:, :, 1:]
    return out


def bfs_distance(free: np.ndarray, source: np.ndarray) -> np.ndarray:
    """(B, H, W) int64 4-connected distance inside ``free`` from the ``source`` cells; -1 if unreachable."""
    dist = np.full(free.shape, -1, dtype=np.int64)
    frontier = source & free
    d = 0
    while frontier.any():
        dist[frontier] = d
        frontier = _dilate(frontier) & free & (dist < 0)
        d += 1
    return dist


def _random_argmax(rng: np.random.Generator, mask: np.ndarray) -> np.ndarray:
    """(N, K) bool -> (N,) index of a uniformly chosen True entry per row (0 for rows with none)."""
    return np.where(mask, rng.random(mask.shape), -1.0).argmax(axis=1)


class MazeTask(SyntheticTask):
    """Shortest-path mazes (see the module docstring); tokens EMPTY..PATH = 0..4, BOS = 5."""

    name = "maze"
    fixed_length = True

    def __init__(
        self,
        height: int = 13,
        width: int = 21,
        n_walls: int = 15,
        min_distance: int = 10,
        val_size: int = 1024,
    ) -> None:
        for arg, value in (("height", height), ("width", width)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 5 or value % 2 == 0:
                raise ValueError(f"{arg} must be an odd int >= 5, got {value!r}")
        check_int("n_walls", n_walls, minimum=0)
        # from any cell, the farthest interior corner is at least this far away
        reach = (height + width - 6) // 2
        check_int("min_distance", min_distance)
        if min_distance > reach:
            raise ValueError(f"min_distance must be <= {reach} for a {height}x{width} maze, got {min_distance}")
        self.height, self.width = height, width
        self.n_walls, self.min_distance = n_walls, min_distance
        self.n_cells = height * width
        super().__init__(2 * self.n_cells, vocab_size=PATH + 2, val_size=val_size)

    @property
    def prompt_mask(self) -> torch.Tensor:
        """(T,) bool: the maze half."""
        return torch.arange(self.seq_len) < self.n_cells

    def _generate(self, batch_size, generator):
        seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device).item())
        rng = np.random.default_rng(seed)
        walls = self._walls(rng, batch_size)  # (B, H, W) bool
        start, goal, dist = self._endpoints(rng, walls)
        path = self._path(rng, dist, start)
        b = np.arange(batch_size)
        maze = walls.astype(np.int64) * WALL
        maze[b, start[:, 0], start[:, 1]] = START
        maze[b, goal[:, 0], goal[:, 1]] = GOAL
        solved = np.where(path, PATH, maze)
        rows = np.concatenate([maze.reshape(batch_size, -1), solved.reshape(batch_size, -1)], axis=1)
        return torch.from_numpy(rows).to(generator.device)

    def _walls(self, rng: np.random.Generator, batch_size: int) -> np.ndarray:
        h, w = self.height, self.width
        border = np.zeros((h, w), dtype=bool)
        border[[0, -1], :] = True
        border[:, [0, -1]] = True
        walls = np.repeat(border[None], batch_size, axis=0)
        placed = np.zeros(batch_size, dtype=np.int64)
        tries = np.zeros(batch_size, dtype=np.int64)
        restarts = np.zeros(batch_size, dtype=np.int64)
        max_k = max(h, w) // 4
        k = np.arange(2 * max_k + 1)  # cell index along a segment
        while (placed < self.n_walls).any():
            todo = np.flatnonzero(placed < self.n_walls)
            n = todo.size
            vertical = rng.random(n) < 0.5
            along_dim = np.where(vertical, h, w)
            across_dim = np.where(vertical, w, h)
            span = 2 * rng.integers(1, along_dim // 4 + 1)  # even length of the segment
            first = 2 * rng.integers(0, (along_dim - 1 - span) // 2 + 1)
            across = 2 * rng.integers(1, (across_dim - 1) // 2)  # interior even line
            on = k[None] <= span[:, None]  # (n, K)
            along = np.minimum(first[:, None] + k[None], first[:, None] + span[:, None])
            r = np.where(vertical[:, None], along, across[:, None])
            c = np.where(vertical[:, None], across[:, None], along)
            overlap = (walls[todo[:, None], r, c] & on).sum(axis=1)
            ok = overlap <= 1
            sel = ok[:, None] & on
            walls[np.broadcast_to(todo[:, None], sel.shape)[sel], r[sel], c[sel]] = True
            placed[todo[ok]] += 1
            tries[todo] += 1
            stuck = todo[tries[todo] > 10 * self.n_walls]
            restarts[stuck] += 1
            if stuck.size and restarts.max() > MAX_RESTARTS:
                raise ValueError(f"n_walls={self.n_walls}: {MAX_RESTARTS} attempts failed to place that many walls "
                                 f"in a {h}x{w} maze; use fewer walls or a larger maze")
            walls[stuck] = border
            placed[stuck] = 0
            tries[stuck] = 0
        return walls

    def _endpoints(self, rng: np.random.Generator, walls: np.ndarray):
        """(B, 2) start, (B, 2) goal and (B, H, W) BFS distance to the goal."""
        B, h, w = walls.shape
        free = ~walls
        goal_flat = _random_argmax(rng, free.reshape(B, -1))
        goal = np.stack(np.unravel_index(goal_flat, (h, w)), axis=1)
        goal_mask = np.zeros_like(free)
        goal_mask[np.arange(B), goal[:, 0], goal[:, 1]] = True
        dist = bfs_distance(free, goal_mask)
        rr, cc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        manhattan = np.abs(rr[None] - goal[:, 0, None, None]) + np.abs(cc[None] - goal[:, 1, None, None])
        candidates = ((dist > 0) & (manhattan >= self.min_distance)).reshape(B, -1)
        if not candidates.any(axis=1).all():  # cannot happen with this wall model (see min_distance check)
            raise RuntimeError("maze generator produced a goal with no admissible start")
        start = np.stack(np.unravel_index(_random_argmax(rng, candidates), (h, w)), axis=1)
        return start, goal, dist

    def _path(self, rng: np.random.Generator, dist: np.ndarray, start: np.ndarray) -> np.ndarray:
        """(B, H, W) bool: cells strictly between start and goal on a uniformly-chosen-step shortest path."""
        B, h, w = dist.shape
        b = np.arange(B)
        path = np.zeros(dist.shape, dtype=bool)
        cur = start.copy()
        d = dist[b, cur[:, 0], cur[:, 1]]
        for _ in range(int(d.max()) - 1):
            active = d > 1
            nxt = cur[:, None, :] + _MOVES[None]  # (B, 4, 2)
            inside = (nxt[..., 0] >= 0) & (nxt[..., 0] < h) & (nxt[..., 1] >= 0) & (nxt[..., 1] < w)
            nr, nc = nxt[..., 0].clip(0, h - 1), nxt[..., 1].clip(0, w - 1)
            closer = inside & (dist[b[:, None], nr, nc] == d[:, None] - 1)
            move = _random_argmax(rng, closer)
            cur = np.where(active[:, None], nxt[b, move], cur)
            d = np.where(active, d - 1, d)
            path[b[active], cur[active, 0], cur[active, 1]] = True
        return path

    def evaluate(self, samples: torch.Tensor) -> dict[str, float]:
        """``correct`` and ``optimal`` fractions of (B, 2 * cells) maze + solution rows.

        correct: the maze half is a maze (cells in EMPTY..GOAL, one start, one
        goal); in the solution half every non-empty maze cell is unchanged and
        every empty one is EMPTY or PATH; and the PATH cells with start and goal
        form one simple 4-connected route: start and goal have exactly one
        route neighbour, each PATH cell exactly two, and all are connected.
        optimal: correct, with ``#PATH + 1`` equal to the BFS start-goal distance.
        """
        x = self._check_samples(samples).cpu().numpy()
        B, h, w = x.shape[0], self.height, self.width
        maze = x[:, : self.n_cells].reshape(B, h, w)
        drawn = x[:, self.n_cells :].reshape(B, h, w)
        maze_ok = (
            ((maze >= EMPTY) & (maze <= GOAL)).all(axis=(1, 2))
            & ((maze == START).sum(axis=(1, 2)) == 1)
            & ((maze == GOAL).sum(axis=(1, 2)) == 1)
        )
        kept = np.where(maze == EMPTY, (drawn == EMPTY) | (drawn == PATH), drawn == maze).all(axis=(1, 2))
        is_path = drawn == PATH
        ends = (drawn == START) | (drawn == GOAL)
        route = is_path | ends
        degree = _neighbour_count(route)
        degree_ok = np.where(is_path, degree == 2, np.where(ends, degree == 1, True)).all(axis=(1, 2))
        reached = bfs_distance(route, drawn == START) >= 0
        connected = (reached == route).all(axis=(1, 2))
        correct = maze_ok & kept & degree_ok & connected
        to_goal = bfs_distance(maze != WALL, maze == GOAL)
        shortest = np.where(maze == START, to_goal, 0).sum(axis=(1, 2))
        optimal = correct & (is_path.sum(axis=(1, 2)) + 1 == shortest)
        return {"correct": float(correct.mean()), "optimal": float(optimal.mean())}

    def decode(self, tokens) -> str:
        """The maze and the drawn path as two grids side by side (' ', '#', 'S', 'G', '*'; '?' otherwise)."""
        t = token_list(tokens)
        if len(t) != self.seq_len:
            raise ValueError(f"a maze sequence has {self.seq_len} tokens, got {len(t)}")
        chars = [CHARS.get(v, "?") for v in t]
        grids = [chars[: self.n_cells], chars[self.n_cells :]]
        lines = []
        for i in range(self.height):
            row = slice(i * self.width, (i + 1) * self.width)
            lines.append("   ".join("".join(g[row]) for g in grids))
        return "\n".join(lines)
