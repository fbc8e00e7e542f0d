"""scripts/plot_benchmarks.py: the markdown tables of a pytest-benchmark JSON, and the budget-run note."""

import json

import pytest

from helpers import plot_script


def quality_entry(n: int, family: str = "sigma") -> dict:
    return dict(kind="steps_quality", task="step", family=family, strategy="burst", acceptance="lossless",
                num_orders=1, diffusion_steps=None, steps_mean=3.4, metric_name="valid", metric_value=0.957,
                metric_ci95=[0.943, 0.968], n_sequences=n)


def write_json(tmp_path, entries: list[dict]):
    path = tmp_path / "bench.json"
    benchmarks = [{"name": f"b{i}", "stats": {"mean": 1.0}, "extra_info": e} for i, e in enumerate(entries)]
    path.write_text(json.dumps({"machine_info": {"sigmafast_device": "CPU: test"}, "benchmarks": benchmarks}))
    return path


@pytest.mark.parametrize("counts,flagged", [((64, 1000), 64), ((1000, 2000), None)], ids=["budget", "full"])
def test_steps_quality_table_flags_fewer_than_1000_sequences(tmp_path, counts, flagged):
    pb = plot_script()
    machine, benchmarks = pb.load(write_json(tmp_path, [quality_entry(n) for n in counts]))
    text = pb.markdown(machine, benchmarks)
    assert "| step | σ-GPT | burst lossless | 3.4 | valid 0.957 | [0.943, 0.968] |" in text
    if flagged is None:
        assert "Budget run" not in text
    else:
        assert f"Budget run: {flagged} sequences per row, below the 1000" in text


def test_small_sample_note_ignores_entries_without_counts():
    pb = plot_script()
    assert pb.small_sample_note([{"kind": "throughput"}]) == []
    assert pb.small_sample_note([{"n_sequences": 999}, {"n_sequences": 5000}])[0].startswith("(Budget run: 999 ")


def test_load_refuses_a_json_that_is_not_pytest_benchmark(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a pytest-benchmark JSON"):
        plot_script().load(path)
