"""Value tasks (vertical_rate, series), their checkpoints and the prompted-MSE evaluation."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import eval_series_script, sample_script, tiny_model

from sigmafast.checkpoint import load_checkpoint, read_checkpoint
from sigmafast.series_eval import evaluate_prompted, markdown_table, prompt_known, sequence_ci
from sigmafast.tasks import get_task
from sigmafast.tasks.oracles import Oracle
from sigmafast.tasks.series import UniformBins
from sigmafast.tasks.vertical_rate import AIRCRAFT, climb_rate, descent_rate
from sigmafast.train import TrainConfig, train


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def vr():
    return get_task("vertical_rate", seq_len=32, interval_s=30.0, val_size=64)


def write_csv(path: Path, values, header=("time", "value", "label")) -> Path:
    lines = [",".join(header)] + [f"{i},{v},x" for i, v in enumerate(values)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def ramp_csv(tmp_path):
    """Values 0..199: train split 0..159, val split 160..199 (val_fraction 0.2)."""
    return write_csv(tmp_path / "ramp.csv", range(200))


# ---------------------------------------------------------------- quantisation


def test_uniform_bins_round_trip_within_half_a_bin():
    bins = UniformBins(-3.0, 17.0, 37)
    v = torch.linspace(-3.0, 17.0 - 1e-9, 10_001, dtype=torch.float64)
    err = (bins.decode(bins.encode(v)) - v).abs()
    assert err.max() <= bins.width / 2 + 1e-12
    assert bins.encode(torch.tensor([-100.0, 100.0])).tolist() == [0, 36]  # clipped outside the range


def test_vertical_rate_tokens_are_multiples_of_the_bin(vr):
    alt = torch.tensor([0.0, 49.0, 51.0, 12_345.0, 41_000.0])
    assert vr.bins.encode(alt).tolist() == [0, 0, 1, 123, 410]
    assert vr.bins.decode(torch.tensor([0, 123, 410])).tolist() == [0.0, 12_300.0, 41_000.0]


@pytest.mark.parametrize("kwargs", [dict(n_bins=0), dict(low=1.0, high=1.0), dict(high=math.inf)])
def test_uniform_bins_reject_bad_arguments(kwargs):
    args = {"low": 0.0, "high": 1.0, "n_bins": 4, **kwargs}
    with pytest.raises(ValueError, match="n_bins|high|low"):
        UniformBins(**args)


# ---------------------------------------------------------------- vertical rate generator


def test_vertical_rate_is_seeded_and_splits_differ(vr):
    a, b = vr.sample_batch(32, "train", gen(0)), vr.sample_batch(32, "train", gen(0))
    assert torch.equal(a, b) and not torch.equal(a, vr.sample_batch(32, "train", gen(1)))
    val = vr.sample_batch(32, "val")
    assert torch.equal(val, vr.sample_batch(32, "val")) and not torch.equal(val, a)
    assert a.shape == (32, 32) and int(a.max()) < vr.bos


def test_profiles_respect_performance_and_reach_the_cleared_level(vr):
    p = vr.profiles(2000, gen(2))
    h, dt = p.altitude, vr.interval_s
    step = h.diff(dim=1)
    k = p.aircraft[:, None]
    up = climb_rate(k, h[:, :-1]) * dt / 60
    down = descent_rate(k, h[:, :-1]) * dt / 60
    assert (step <= up + 1e-6).all() and (-step <= down + 1e-6).all()
    # the generator flies close to the envelope (performance factor up to 1), not far inside it
    climbing = step > 0
    assert (step[climbing] / up[climbing]).max() > 0.95
    assert (-step[step < 0] / down[step < 0]).max() > 0.95
    climb = (p.cleared > p.start)[:, None]
    assert torch.where(climb, step >= 0, step <= 0).all()  # no overshoot, no reversal
    assert torch.equal(h[:, 0], p.start) and torch.equal(h[:, -1], p.cleared)
    top = torch.tensor([a.max_level for a in AIRCRAFT], dtype=torch.float64)[p.aircraft]
    assert ((p.cleared >= 1000) & (p.cleared <= top) & (p.cleared % 1000 == 0)).all()
    # every type occurs, and level-offs hold the intermediate level for the drawn time
    assert torch.bincount(p.aircraft, minlength=len(AIRCRAFT)).min() > 300
    assert 0.2 < p.level_off.double().mean() < 0.5
    held = ((h[:, 1:] == p.mid[:, None]) & (h[:, :-1] == p.mid[:, None])).sum(dim=1)
    lo = p.level_off
    assert (held[lo] >= (p.hold[lo] / dt).floor() - 1).all()


def test_readings_are_noisy_quantised_profiles(vr):
    p = vr.profiles(256, gen(3))
    x = vr.sample_batch(256, "train", gen(3))  # the same draws, then the noise
    assert torch.equal(x[:, 0] - vr.type_offset, p.aircraft)
    err = vr.bins.decode(x[:, 1:]) - p.altitude
    assert err.abs().max() <= vr.bin_ft / 2 + 5 * vr.noise_ft
    quiet = get_task("vertical_rate", seq_len=32, interval_s=30.0, noise_ft=0.0)
    y = quiet.sample_batch(256, "train", gen(3))
    assert (quiet.bins.decode(y[:, 1:]) - quiet.profiles(256, gen(3)).altitude).abs().max() <= quiet.bin_ft / 2


def test_vertical_rate_evaluate(vr):
    x = vr.sample_batch(256, "train", gen(4))
    assert vr.evaluate(x) == {"within_limits": 1.0, "valid": 1.0}
    jump = x.clone()
    jump[:, 10] = (jump[:, 10] + 80) % vr.type_offset  # 8000 ft in one reading, or down to the ground
    assert vr.evaluate(jump)["within_limits"] == 0.0
    not_level = x.clone()
    not_level[:, -1] = (not_level[:, -1] / 10).round().long() * 10 + 5  # 500 ft off the nearest level
    assert vr.evaluate(not_level)["valid"] == 0.0
    typeless = x.clone()
    typeless[:, 0] = 7
    assert vr.evaluate(typeless)["valid"] == 0.0


def test_vertical_rate_decode(vr):
    x = vr.sample_batch(1, "train", gen(5))[0]
    text = vr.decode(x)
    name, *altitudes = text.removesuffix(" ft").split()
    assert name.rstrip(":") in {a.name for a in AIRCRAFT}
    assert [int(a) for a in altitudes] == (x[1:] * vr.bin_ft).tolist()
    assert vr.decode([vr.bos, 3, vr.type_offset + 3, vr.bos + 1]) == "<bos> 300 piston: ? ft"


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=10), "window"), (dict(interval_s=0.0), "interval_s"), (dict(bin_ft=0), "bin_ft"),
    (dict(p_level_off=1.5), "p_level_off"), (dict(noise_ft=math.nan), "noise_ft"),
])
def test_vertical_rate_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_task("vertical_rate", **kwargs)


# ---------------------------------------------------------------- CSV series


def test_series_bins_come_from_the_train_split(ramp_csv):
    task = get_task("series", csv=str(ramp_csv), column="value", seq_len=8, n_bins=16)
    lo, hi = np.quantile(np.arange(160.0), [0.001, 0.999])
    assert (task.bins.low, task.bins.high) == (lo, hi)
    val = task.sample_batch(64, "val", gen(0))
    assert (val == 15).all()  # every validation value (160..199) is above the train range: last bin
    other = write_csv(ramp_csv.parent / "other.csv", list(range(160)) + [1e6] * 40)
    assert get_task("series", csv=str(other), column="value", seq_len=8, n_bins=16).bins == task.bins


def test_series_windows_are_seeded_chronological_and_within_half_a_bin(ramp_csv):
    task = get_task("series", csv=str(ramp_csv), column="value", seq_len=8, n_bins=64, range_quantile=0.0)
    x = task.sample_batch(128, "train", gen(1))
    assert torch.equal(x, task.sample_batch(128, "train", gen(1)))
    values = task.bins.decode(x)  # (B, 8)
    windows = torch.arange(160 - 8 + 1, dtype=torch.float64)[:, None] + torch.arange(8)  # every train window
    err = (values[:, None, :] - windows[None]).abs().amax(dim=2)  # (B, windows)
    assert (err.amin(dim=1) <= task.bins.width / 2 + 1e-9).all()
    assert not torch.equal(x, task.sample_batch(128, "val", gen(1)))


@pytest.mark.parametrize("case,match", [
    ("missing_file", "no CSV file"), ("missing_column", r"'speed' is not in .*available columns: 'time', 'value'"),
    ("text_cell", r"line 5: column 'value' holds 'abc'"), ("empty_cell", r"line 3: column 'value' holds ''"),
    ("nan_cell", "holds 'nan'"), ("too_short", r"shorter than one window of seq_len=8"), ("no_csv", "csv=PATH"),
    ("no_column", "column=NAME"), ("constant", "constant"), ("empty_file", "empty"),
])
def test_series_errors(tmp_path, case, match):
    path = tmp_path / "data.csv"
    column = "value"
    kwargs = {}
    if case == "missing_column":
        write_csv(path, range(50), header=("time", "value"))
        column = "speed"
    elif case in ("text_cell", "empty_cell", "nan_cell"):
        cell = {"text_cell": (3, "abc"), "empty_cell": (1, ""), "nan_cell": (0, "nan")}[case]
        values = [str(v) for v in range(50)]
        values[cell[0]] = cell[1]
        write_csv(path, values)
    elif case == "too_short":
        write_csv(path, range(30))  # val split: 6 rows
    elif case == "constant":
        write_csv(path, [3.0] * 50)
    elif case == "empty_file":
        path.write_text("")
    elif case == "no_csv":
        kwargs["csv"] = None
    elif case == "no_column":
        write_csv(path, range(50))
        column = None
    error = FileNotFoundError if case == "missing_file" else ValueError
    with pytest.raises(error, match=match):
        get_task("series", **{"csv": str(path), "column": column, "seq_len": 8, **kwargs})


@pytest.fixture
def series_ckpt(tmp_path, ramp_csv):
    cfg = TrainConfig(task="series", csv=str(ramp_csv), column="value", seq_len=8, preset="tiny", max_iters=1,
                      batch_size=4, eval_interval=1, eval_iters=1, log_interval=1, num_eval_samples=0,
                      out_dir=str(tmp_path / "run"))
    result = train(cfg)
    return result.checkpoint_path, result.task


def test_checkpoint_keeps_the_bins_when_the_csv_changes_or_goes(series_ckpt, ramp_csv):
    path, trained = series_ckpt
    assert read_checkpoint(path)["task"]["kwargs"]["csv"] == str(ramp_csv.resolve())
    write_csv(ramp_csv, [1000.0 * v for v in range(500)])
    _, task, cfg = load_checkpoint(path)
    assert cfg.csv == str(ramp_csv) and task.bins == trained.bins
    ramp_csv.unlink()
    _, task, _ = load_checkpoint(path)
    assert task.bins == trained.bins
    tokens = torch.tensor([0, 5, trained.bos])
    assert task.decode(tokens) == trained.decode(tokens)
    with pytest.raises(FileNotFoundError, match="no CSV file"):
        task.sample_batch(2, "train", gen(0))


# ---------------------------------------------------------------- prompted evaluation


class MarginalOracle(Oracle):
    """Every unknown position is drawn from one fixed law ``probs`` over tokens 0..len(probs)-1."""

    def __init__(self, task, probs: torch.Tensor) -> None:
        super().__init__(task, n_real=len(probs))
        self.probs = probs

    def _probs(self, canvas, known, positions, drafts=None):
        return self.probs.to(canvas.device).expand(*positions.shape, len(self.probs))


def test_prompt_known(vr, tmp_path):
    n = vr.seq_len - 1
    assert prompt_known(vr, 0.0).tolist() == [True] + [False] * n
    assert prompt_known(vr, 0.5).tolist() == [True] * (1 + n // 2) + [False] * (n - n // 2)
    hundred = get_task("series", csv=str(write_csv(tmp_path / "long.csv", range(600))), column="value", seq_len=100)
    assert [int(prompt_known(hundred, f).sum()) for f in (0.29, 0.57, 0.58)] == [29, 57, 58]  # 0.29 * 100 < 29


def test_validation_sequences_are_distinct(vr, ramp_csv):
    """The CI of evaluate_prompted takes its sequences as independent: no row twice, no shared value."""
    rows = vr.val_sequences(64, gen(1))
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, vr.sample_batch(64, "val").tolist()))  # all, once
    assert not torch.equal(rows, vr.val_sequences(64, gen(2))) and torch.equal(rows, vr.val_sequences(64, gen(1)))
    with pytest.raises(ValueError, match="num_sequences \\(65\\) exceeds the 64 validation rows"):
        vr.val_sequences(65, gen(1))
    series = get_task("series", csv=str(ramp_csv), column="value", seq_len=8, value_range=(0.0, 256.0))
    tokens = series.val_sequences(5, gen(3))  # (5, 8) of the val split's values 160..199, one bin per value
    assert torch.equal(tokens - tokens[:, :1], torch.arange(8).expand(5, 8))
    assert torch.equal(tokens[:, 0].sort().values.diff(), torch.full((4,), 8))  # 5 windows side by side
    with pytest.raises(ValueError, match="num_sequences \\(6\\) exceeds the 5 windows of seq_len=8 that share no"):
        series.val_sequences(6, gen(3))


def test_series_csv_with_a_byte_order_mark_or_not_utf8(tmp_path):
    bom = tmp_path / "bom.csv"
    bom.write_text("time,value\n" + "".join(f"{i},{i}\n" for i in range(50)), encoding="utf-8-sig")
    assert get_task("series", csv=str(bom), column="time", seq_len=8).split_values("train")[:3].tolist() == [0, 1, 2]
    latin = tmp_path / "latin.csv"
    latin.write_bytes("caf\u00e9,value\n".encode("latin-1") + b"".join(b"%d,%d\n" % (i, i) for i in range(50)))
    with pytest.raises(ValueError, match=f"series task: {latin} is not UTF-8 text"):
        get_task("series", csv=str(latin), column="value", seq_len=8)


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_prompted_mse_matches_the_exact_law(vr, fraction):
    support = torch.tensor([0, 50, 120, 300])
    probs = torch.zeros(vr.bins.n_bins, dtype=torch.float64)
    probs[support] = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    g = gen(6)
    state = g.get_state()
    N, S = 12, 20
    results = evaluate_prompted(MarginalOracle(vr, probs), vr, [fraction], ["random", "fractal"], S, N, g)
    truth = vr.val_sequences(N, torch.Generator().set_state(state))
    y = vr.bins.decode(truth[:, 1:])  # (N, n)
    c = vr.bins.decode(support)  # (4,)
    sq = (c[None, None] - y[..., None]).square()  # (N, n, 4)
    p = probs[support]
    generated = ~prompt_known(vr, fraction)[1:]
    mean_j = (sq * p).sum(-1) * generated  # (N, n) expected squared error per position
    var_j = ((sq.square() * p).sum(-1) - mean_j.square()) * generated
    n = y.shape[1]
    expected = mean_j.sum(1).mean() / n
    se = (var_j.sum(1).sum() * S).sqrt() / (n * N * S)
    for r in results:
        assert r.num_samples == N * S and r.invalid == 0.0
        assert abs(r.mse_mean - expected) < 5 * se, (r, expected, se)


def test_invalid_tokens_are_counted(vr):
    probs = torch.zeros(vr.vocab_size - 1, dtype=torch.float64)
    probs[100], probs[vr.type_offset] = 0.7, 0.3  # 30% of draws are an aircraft type
    r, = evaluate_prompted(MarginalOracle(vr, probs), vr, [0.0], ["left-to-right"], 10, 10, gen(7))
    draws = 100 * (vr.seq_len - 1)
    assert abs(r.invalid - 0.3) < 5 * math.sqrt(0.3 * 0.7 / draws)


def test_evaluate_prompted_on_a_tiny_model_is_reproducible():
    vr = get_task("vertical_rate", seq_len=12, interval_s=60.0, val_size=8)
    model = tiny_model(vocab_size=vr.vocab_size, block_size=vr.seq_len, dtype=torch.float32)
    kwargs = dict(fractions=(0.0, 0.1, 0.5), orders=("left-to-right", "random", "fractal"),
                  samples_per_sequence=2, num_sequences=3)
    a = evaluate_prompted(model, vr, generator=gen(8), **kwargs)
    assert [(r.fraction, r.order) for r in a] == [(f, o) for f in kwargs["fractions"] for o in kwargs["orders"]]
    assert all(math.isfinite(r.mse_mean) and r.mse_std >= 0 and r.num_samples == 6 and r.mse_ci >= 0 for r in a)
    assert a == evaluate_prompted(model, vr, generator=gen(8), **kwargs)
    table = markdown_table(a, "ft")
    assert "| fractal |" in table and "| order \\ prompt | 0% | 10% | 50% |" in table and "ft²" in table
    assert f"[{a[0].mse_mean - a[0].mse_ci:.3g}, {a[0].mse_mean + a[0].mse_ci:.3g}]" in table


def test_sequence_ci_groups_samples_by_sequence():
    """Sequence-major grouping: spread between sequences widens the CI, spread within one does not; the
    quantile is Student's t with one degree of freedom fewer than the sequences."""
    between = torch.tensor([1.0, 1.0, 1.0, 3.0, 3.0, 3.0])  # 2 sequences x 3 samples
    within = torch.tensor([1.0, 3.0, 2.0, 1.0, 3.0, 2.0])
    assert sequence_ci(between, 2) == pytest.approx(12.706205 * math.sqrt(2.0) / math.sqrt(2))  # t(0.975, 1)
    assert sequence_ci(within, 2) == 0.0
    assert sequence_ci(between, 6) == pytest.approx(2.570582 * between.std().item() / math.sqrt(6))  # t(.975, 5)
    assert math.isnan(sequence_ci(between, 1))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(fractions=(1.0,)), ValueError, "fractions"), (dict(orders=("sideways",)), ValueError, "orders"),
    (dict(samples_per_sequence=0), ValueError, "samples_per_sequence"),
    (dict(generator=3), TypeError, "generator"), (dict(fractions=(0.5, 0.5)), ValueError, "fractions must not repeat"),
    (dict(orders=("random", "fractal", "random")), ValueError, "orders must not repeat"),
])
def test_evaluate_prompted_bad_arguments(vr, kwargs, error, match):
    model = tiny_model(vocab_size=vr.vocab_size, block_size=vr.seq_len, dtype=torch.float32)
    with pytest.raises(error, match=match):
        evaluate_prompted(model, vr, **kwargs)


def test_evaluate_prompted_needs_a_value_task():
    task = get_task("step", seq_len=12)
    with pytest.raises(TypeError, match="value task"):
        evaluate_prompted(task.oracle(), task)


def test_live_view_shows_the_unit_once(vr):
    """sample.py --live renders tokens one by one: a vertical-rate row reads 'heavy_jet: 1000 _ ...', not
    'heavy_jet: ft 1000 ft _ ...'."""
    script = sample_script()
    row = torch.tensor([vr.type_offset, 10, 12] + [0] * (vr.seq_len - 3))
    known = torch.arange(vr.seq_len) < 3
    assert script.render(vr, row, known) == "heavy_jet: 1000 1200 " + " ".join(["_"] * (vr.seq_len - 3))
    assert vr.decode(row[:3]) == "heavy_jet: 1000 1200 ft"


def test_eval_series_script(series_ckpt, capsys):
    path, _ = series_ckpt
    script = eval_series_script()
    argv = ["--checkpoint", str(path), "--num-sequences", "2", "--samples-per-sequence", "2"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "task series" in out and all(f"| {o} |" in out for o in ("left-to-right", "random", "fractal"))
    assert script.main(argv + ["--fractions", "0,x"]) == 2
    assert capsys.readouterr().err == "error: --fractions must be comma-separated numbers, got '0,x'\n"
    assert script.main(argv + ["--orders", "sideways"]) == 2
    assert capsys.readouterr().err.startswith("error: --orders must be a non-empty sequence of")
    assert script.main(["--checkpoint", str(path), "--num-sequences", "0"]) == 2
    assert capsys.readouterr().err == "error: --num-sequences must be an int >= 1, got 0\n"
    assert script.main(argv + ["--fractions", "0,0"]) == 2
    assert capsys.readouterr().err.startswith("error: --fractions must not repeat a value")


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_eval_series_script_rejects_a_seed_out_of_range(seed, capsys, tmp_path):
    script = eval_series_script()  # checked before the checkpoint is read, as scripts/sample.py does
    assert script.main(["--checkpoint", str(tmp_path / "ckpt.pt"), "--seed", seed]) == 2
    assert f"--seed must be in [0, 2**63), got {seed}" in capsys.readouterr().err


def test_eval_series_script_refuses_a_diffusion_checkpoint(tmp_path, ramp_csv, capsys):
    cfg = TrainConfig(task="series", csv=str(ramp_csv), column="value", seq_len=8, preset="tiny", max_iters=1,
                      batch_size=4, eval_interval=1, eval_iters=1, log_interval=1, objective="diffusion",
                      out_dir=str(tmp_path / "run"))
    path = train(cfg).checkpoint_path
    assert eval_series_script().main(["--checkpoint", str(path), "--num-sequences", "2"]) == 2
    assert "holds a diffusion model: eval_series.py samples σ-GPT checkpoints" in capsys.readouterr().err
