"""Vertical-rate task: altitude profiles of aircraft climbing or descending to a cleared level.

The σ-GPT paper's third domain (aircraft vertical-rate prediction) uses a data
set that is not public; this is a seeded synthetic stand-in.

Sequence (T = ``seq_len``): token 0 is the aircraft type (the conditioning
token, always given at test time: :attr:`VerticalRateTask.prompt_mask`), then
``n = T - 1`` altitude readings taken every ``interval_s`` seconds.

Physics (one profile). Each type (:data:`AIRCRAFT`) has a rate of climb that
falls linearly with altitude h and vanishes at its absolute ceiling H (the
classical excess-power approximation)::

    ROC(h) = ROC_0 * max(0, 1 - h / H)                                  [ft/min]

and a descent rate that grows linearly with altitude (higher true airspeed at
the same descent angle; about 250 kt below FL100)::

    ROD(h) = ROD_low + (ROD_high - ROD_low) * h / H                     [ft/min]

A profile multiplies both by a performance factor ``eta ~ U[0.8, 1]`` (weight,
temperature), so it never beats its type's curves. Both laws are linear ODEs,
integrated exactly: a climb from h_0 follows ``h(s) = H - (H - h_0) exp(-a s / H)``
with ``a = eta ROC_0 / 60`` ft/s, a descent ``h(s) = (h_0 + c) exp(-k s) - c`` with
``k = eta (ROD_high - ROD_low) / (60 H)`` and ``c = ROD_low H / (ROD_high - ROD_low)``,
each stopping exactly at its target. Since the rate falls as the aircraft
approaches its target in either direction, a step of ``interval_s`` starting at
``h`` moves at most ``ROC(h) * interval_s / 60`` up or ``ROD(h) * interval_s / 60``
down.

Manoeuvre. Levels are multiples of 1000 ft from 1000 ft to the type's highest
cleared level. The generator draws, independently and uniformly: the type;
two distinct levels; climb (lower to upper) or descent (upper to lower); the
performance factor; a delay in [0, 120] s at the current level before the
manoeuvre starts; and, with probability ``p_level_off`` when the levels are at
least 2000 ft apart, an intermediate clearance (a uniform level strictly
between) held for a uniform [60, 240] s before continuing. A draw whose
manoeuvre does not end by the last reading is rejected and redrawn (all of
it, type included), so every profile reaches its cleared level inside the
window; slow types therefore get smaller level changes in short windows.

Readings. Each reading adds Gaussian measurement noise of std ``noise_ft``
and is quantised to ``bin_ft`` feet: token k is altitude ``k * bin_ft`` (bins
centred on multiples of ``bin_ft``), so quantisation errs by at most
``bin_ft / 2``; readings below 0 or above the top bin (1000 ft above the
highest cleared level) are clipped. Type tokens follow the altitude tokens;
BOS is the last id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .series import UniformBins
from .synthetic import SyntheticTask, check_int, token_list

LEVEL_STEP_FT = 1000.0  # cleared levels are multiples of this
MIN_LEVEL_FT = 1000.0  # lowest cleared level
PERFORMANCE = (0.8, 1.0)  # range of the per-profile factor on every rate
DELAY_S = (0.0, 120.0)  # wait at the current level before the manoeuvre
HOLD_S = (60.0, 240.0)  # duration of an intermediate level-off
MIN_WINDOW_S = 600.0  # shortest window (seq_len - 2) * interval_s accepted
TOP_MARGIN_FT = 1000.0  # the altitude bins reach this far above the highest cleared level
NOISE_BOUND = 5.0  # evaluate's tolerance: a reading errs by at most bin/2 + NOISE_BOUND * noise_ft


@dataclass(frozen=True)
class Aircraft:
    """Climb and descent performance of one aircraft type (round figures in the range of published data)."""

    name: str
    climb_rate: float  # ROC_0, ft/min at sea level
    ceiling: float  # H, ft: absolute ceiling, where the climb rate reaches 0
    max_level: float  # ft: highest cleared level (below the ceiling)
    descent_low: float  # ROD_low, ft/min at sea level
    descent_high: float  # ROD_high, ft/min at the ceiling (> descent_low)


AIRCRAFT: tuple[Aircraft, ...] = (
    Aircraft("heavy_jet", climb_rate=2500, ceiling=45000, max_level=41000, descent_low=1500, descent_high=3000),
    Aircraft("medium_jet", climb_rate=3000, ceiling=42000, max_level=39000, descent_low=1500, descent_high=3000),
    Aircraft("turboprop", climb_rate=1500, ceiling=27000, max_level=25000, descent_low=1000, descent_high=2000),
    Aircraft("piston", climb_rate=720, ceiling=16000, max_level=12000, descent_low=500, descent_high=700),
)


class Profiles(NamedTuple):
    """Noise-free profiles of a batch; altitudes in ft."""

    aircraft: torch.Tensor  # (B,) int64 index into AIRCRAFT
    altitude: torch.Tensor  # (B, n) float64 true altitude at each reading
    start: torch.Tensor  # (B,) level at the first reading
    mid: torch.Tensor  # (B,) intermediate level (= cleared without a level-off)
    cleared: torch.Tensor  # (B,) final cleared level
    level_off: torch.Tensor  # (B,) bool
    hold: torch.Tensor  # (B,) s at the intermediate level (0 without a level-off)


def _table(device) -> dict[str, torch.Tensor]:
    """Per-type parameters as (K,) float64 tensors."""
    names = ("climb_rate", "ceiling", "max_level", "descent_low", "descent_high")
    return {n: torch.tensor([getattr(a, n) for a in AIRCRAFT], dtype=torch.float64, device=device) for n in names}


def climb_rate(aircraft: torch.Tensor, altitude: torch.Tensor) -> torch.Tensor:
    """ROC(h) in ft/min of each type at each altitude (broadcast), at full performance."""
    p = _table(altitude.device)
    roc, ceiling = p["climb_rate"][aircraft], p["ceiling"][aircraft]
    return roc * (1.0 - altitude / ceiling).clamp_min(0.0)


def descent_rate(aircraft: torch.Tensor, altitude: torch.Tensor) -> torch.Tensor:
    """ROD(h) in ft/min (positive) of each type at each altitude (broadcast), at full performance."""
    p = _table(altitude.device)
    low, high, ceiling = p["descent_low"][aircraft], p["descent_high"][aircraft], p["ceiling"][aircraft]
    return low + (high - low) * altitude.clamp_min(0.0) / ceiling


def _level_ft(level: torch.Tensor) -> torch.Tensor:
    """Level index (0 = MIN_LEVEL_FT) -> altitude in ft."""
    return MIN_LEVEL_FT + LEVEL_STEP_FT * level


def _segment(h0, target, s, roc, ceiling, k, c):
    """Altitude s seconds after leaving h0 for target (h0 before, target once reached); see the docstring."""
    s = s.clamp_min(0.0)
    up = (ceiling - (ceiling - h0) * torch.exp(-roc * s / ceiling)).minimum(target)
    down = ((h0 + c) * torch.exp(-k * s) - c).maximum(target)
    return torch.where(target > h0, up, torch.where(target < h0, down, h0))


def _duration(h0, target, roc, ceiling, k, c):
    """Seconds from h0 to target."""
    up = ceiling / roc * torch.log((ceiling - h0) / (ceiling - target).clamp_min(1e-9))
    down = torch.log((h0 + c) / (target + c)) / k
    return torch.where(target > h0, up, torch.where(target < h0, down, torch.zeros_like(h0)))


class VerticalRateTask(SyntheticTask):
    """Climb and descent altitude profiles conditioned on the aircraft type (see the module docstring)."""

    name = "vertical_rate"
    unit = "ft"

    def __init__(
        self,
        seq_len: int = 64,
        interval_s: float = 20.0,
        bin_ft: int = 100,
        noise_ft: float = 30.0,
        p_level_off: float = 0.5,
        val_size: int = 512,
    ) -> None:
        check_int("seq_len", seq_len, minimum=3)
        for arg, value in (("interval_s", interval_s), ("noise_ft", noise_ft), ("p_level_off", p_level_off)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{arg} must be a finite number, got {value!r}")
        if interval_s <= 0 or noise_ft < 0 or not 0 <= p_level_off <= 1:
            raise ValueError(f"need interval_s > 0, noise_ft >= 0 and p_level_off in [0, 1], got "
                             f"{interval_s!r}, {noise_ft!r}, {p_level_off!r}")
        if (seq_len - 2) * interval_s < MIN_WINDOW_S:
            raise ValueError(f"seq_len and interval_s give a window of (seq_len - 2) * interval_s = "
                             f"{(seq_len - 2) * interval_s:g} s; it must be >= {MIN_WINDOW_S:g} s to fit a manoeuvre")
        check_int("bin_ft", bin_ft)
        self.interval_s, self.bin_ft = float(interval_s), bin_ft
        self.noise_ft, self.p_level_off = float(noise_ft), float(p_level_off)
        n_alt = int((max(a.max_level for a in AIRCRAFT) + TOP_MARGIN_FT) // bin_ft) + 1
        self.bins = UniformBins(-bin_ft / 2, (n_alt - 0.5) * bin_ft, n_alt)
        self.type_offset = n_alt  # token of AIRCRAFT[i] is type_offset + i
        super().__init__(seq_len, vocab_size=n_alt + len(AIRCRAFT) + 1, val_size=val_size)

    @property
    def prompt_mask(self) -> torch.Tensor:
        """(T,) bool: the aircraft type token."""
        return torch.arange(self.seq_len) == 0

    @property
    def value_positions(self) -> torch.Tensor:
        """(T,) bool: the altitude readings."""
        return torch.arange(self.seq_len) > 0

    def profiles(self, batch_size: int, generator: torch.Generator) -> Profiles:
        """Noise-free profiles; :meth:`sample_batch` with a generator in the same state reads these."""
        n = self.seq_len - 1
        dev = generator.device
        times = torch.arange(n, dtype=torch.float64, device=dev) * self.interval_s  # (n,)
        kept, need = [], batch_size
        for _ in range(1000):
            m = self._manoeuvres(need, generator)
            fits = m["end"] <= times[-1]
            kept.append({k: v[fits] for k, v in m.items()})
            need -= int(fits.sum())
            if need <= 0:
                break
        else:
            raise RuntimeError("vertical_rate: too many rejected manoeuvres; lengthen the window")
        m = {k: torch.cat([part[k] for part in kept])[:batch_size] for k in kept[0]}
        t = times[None]  # (1, n)
        col = {k: v[:, None] for k, v in m.items()}  # (B, 1)
        perf = (col["roc"], col["ceiling"], col["k"], col["c"])
        first = _segment(col["start"], col["mid"], t - col["delay"], *perf)
        second_start = col["delay"] + col["t_first"] + col["hold"]
        second = _segment(col["mid"], col["cleared"], t - second_start, *perf)
        altitude = torch.where(t < second_start, first, second)  # (B, n)
        return Profiles(m["aircraft"].long(), altitude, m["start"], m["mid"], m["cleared"], m["level_off"].bool(),
                        m["hold"])

    def _manoeuvres(self, count: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        """``count`` candidate manoeuvres (see the module docstring) with their end time ``end`` in s."""
        dev = g.device
        u = torch.rand(count, 9, generator=g, device=dev, dtype=torch.float64)
        p = _table(dev)
        aircraft = (u[:, 0] * len(AIRCRAFT)).long()
        n_levels = (p["max_level"][aircraft] - MIN_LEVEL_FT) / LEVEL_STEP_FT + 1  # levels 0 .. n_levels - 1
        a = (u[:, 1] * n_levels).floor()
        b = (u[:, 2] * (n_levels - 1)).floor()
        b = b + (b >= a).double()
        lower, upper = a.minimum(b), a.maximum(b)
        climb = u[:, 3] < 0.5
        level_off = (u[:, 4] < self.p_level_off) & (upper - lower >= 2)
        mid = lower + 1 + (u[:, 5] * (upper - lower - 1)).floor()
        start, cleared = _level_ft(torch.where(climb, lower, upper)), _level_ft(torch.where(climb, upper, lower))
        mid = torch.where(level_off, _level_ft(mid), cleared)
        eta = PERFORMANCE[0] + (PERFORMANCE[1] - PERFORMANCE[0]) * u[:, 6]
        delay = DELAY_S[0] + (DELAY_S[1] - DELAY_S[0]) * u[:, 7]
        hold = torch.where(level_off, HOLD_S[0] + (HOLD_S[1] - HOLD_S[0]) * u[:, 8], torch.zeros_like(delay))
        ceiling = p["ceiling"][aircraft]
        low, high = p["descent_low"][aircraft], p["descent_high"][aircraft]
        roc = eta * p["climb_rate"][aircraft] / 60.0  # ft/s at sea level
        k = eta * (high - low) / (60.0 * ceiling)  # 1/s
        c = low * ceiling / (high - low)  # ft
        t_first = _duration(start, mid, roc, ceiling, k, c)
        end = delay + t_first + hold + _duration(mid, cleared, roc, ceiling, k, c)
        return dict(aircraft=aircraft.double(), start=start, mid=mid, cleared=cleared, level_off=level_off.double(),
                    delay=delay, hold=hold, roc=roc, ceiling=ceiling, k=k, c=c, t_first=t_first, end=end)

    def _generate(self, batch_size, generator):
        prof = self.profiles(batch_size, generator)
        noise = torch.randn(prof.altitude.shape, generator=generator, device=generator.device, dtype=torch.float64)
        readings = self.bins.encode(prof.altitude + self.noise_ft * noise)  # (B, n)
        return torch.cat([(self.type_offset + prof.aircraft)[:, None], readings], dim=1)

    def evaluate(self, samples: torch.Tensor) -> dict[str, float]:
        """Fractions of rows that are well formed and physically plausible.

        ``within_limits``: token 0 is a type, every other token an altitude, and
        each step between readings stays within the type's envelope, allowing each
        reading an error of ``e = bin_ft / 2 + 5 noise_ft``: a climb from reading r
        gains at most ``ROC(r - e) dt / 60 + 2 e``, a descent loses at most
        ``ROD(r + e) dt / 60 + 2 e``. ``valid``: within limits and the last reading
        within ``e`` of a level the type may be cleared to.
        """
        x = self._check_samples(samples)
        n_alt = self.type_offset
        is_type = (x[:, 0] >= n_alt) & (x[:, 0] < n_alt + len(AIRCRAFT))
        well_formed = is_type & (x[:, 1:] < n_alt).all(dim=1)
        aircraft = (x[:, :1] - n_alt).clamp(0, len(AIRCRAFT) - 1)  # (B, 1)
        r = self.bins.decode(x[:, 1:])  # (B, n) ft
        e = self.bin_ft / 2 + NOISE_BOUND * self.noise_ft
        step = r.diff(dim=1)
        up = climb_rate(aircraft, (r[:, :-1] - e).clamp_min(0.0)) * self.interval_s / 60 + 2 * e
        down = descent_rate(aircraft, r[:, :-1] + e) * self.interval_s / 60 + 2 * e
        within = well_formed & ((step <= up) & (-step <= down)).all(dim=1)
        last = r[:, -1]
        level = ((last - MIN_LEVEL_FT) / LEVEL_STEP_FT).round().clamp_min(0.0)
        nearest = _level_ft(level).minimum(_table(x.device)["max_level"][aircraft[:, 0]])
        on_level = (last - nearest).abs() <= e
        return {"within_limits": within.double().mean().item(), "valid": (within & on_level).double().mean().item()}

    def token_text(self, token: int) -> str:
        """An aircraft type as ``name:``, an altitude in ft (no unit), ``<bos>``, ``?`` for other ids."""
        n_alt, v = self.type_offset, int(token)
        if 0 <= v < n_alt:
            return str(v * self.bin_ft)
        if n_alt <= v < n_alt + len(AIRCRAFT):
            return AIRCRAFT[v - n_alt].name + ":"
        return "<bos>" if v == self.bos else "?"

    def decode(self, tokens) -> str:
        """The tokens as :meth:`token_text` shows them, then `` ft``."""
        return " ".join(self.token_text(v) for v in token_list(tokens)) + " ft"
