"""Plots and markdown tables from a pytest-benchmark JSON of ``pytest benchmarks/``.

    pytest benchmarks/ --benchmark-only --benchmark-json=/tmp/bench.json
    python scripts/plot_benchmarks.py /tmp/bench.json             # benchmarks/steps.png + throughput.png
    python scripts/plot_benchmarks.py /tmp/bench.json --markdown  # the tables of benchmarks/RESULTS.md

The steps figure redraws the paper's "performance vs steps" plot: task
validity against the mean number of burst iterations for 1…N verification
orders (and the lossless rule), with the paper's / theory's step counts and
the autoregressive step count as vertical lines. Top row: exact oracles;
bottom row: the small trained models. The throughput figure shows tokens/s
per strategy. ``steps_quality.png`` (``bench_steps_quality.py``) puts σ-GPT (AR, burst), the exact
oracle and discrete diffusion on one metric-vs-steps panel per task. Plotting needs matplotlib
(``pip install -e ".[plot]"``); the markdown tables do not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "benchmarks"
MY_KINDS = ("oracle_steps", "model_steps", "throughput", "orders", "steps_quality")
FAMILY_LABELS = {"sigma": "σ-GPT", "oracle": "exact oracle", "diffusion-absorbing": "diffusion (absorbing)",
                 "diffusion-uniform": "diffusion (uniform)"}
TASK_ORDER = ("product", "step", "permutation", "maze", "char")


def load(path: Path) -> tuple[dict, list[dict]]:
    data = json.loads(Path(path).read_text())
    if "benchmarks" not in data:
        raise ValueError(f"{path} is not a pytest-benchmark JSON (no 'benchmarks' key)")
    return data.get("machine_info", {}), data["benchmarks"]


def by_kind(benchmarks: list[dict], kind: str) -> list[dict]:
    return [b["extra_info"] for b in benchmarks if b.get("extra_info", {}).get("kind") == kind]


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if abs(x) >= 1e4:
            return f"{x:,.0f}"
        return f"{x:.{digits}f}"
    return str(x)


def rule_label(e: dict) -> str:
    strategy, prefix = e["strategy"], ""
    if strategy.startswith("reference-"):
        strategy, prefix = strategy[len("reference-"):], "naive reference, "
    if strategy == "autoregressive":
        return prefix + "autoregressive"
    n = e["num_orders"]
    orders = f", {n} order{'s' if n != 1 else ''}" if e["acceptance"] == "paper" else ""
    return f"{prefix}burst {e['acceptance']}{orders}"


def _rank(name: str) -> tuple:
    return (TASK_ORDER.index(name) if name in TASK_ORDER else len(TASK_ORDER), name)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def oracle_table(entries: list[dict]) -> str:
    rows = []
    for e in sorted(entries, key=lambda e: (_rank(e["task"]), e["acceptance"] != "paper", e["num_orders"])):
        rows.append([
            e["task"], rule_label(e), f"{e['iterations_mean']:.2f} ± {e['iterations_std']:.2f}",
            f"{e['metric_name']} {e['metric_value']:.3f}", e.get("paper_note"), e.get("sim_note"), e["n_sequences"],
        ])
    return table(["task (T=100)", "rule", "iterations (mean ± std)", "validity", "paper / theory",
                  "perfect-model simulation", "sequences"], rows)


def model_table(entries: list[dict]) -> str:
    rows = []
    for e in sorted(entries, key=lambda e: (_rank(e["model"]), e["strategy"] != "autoregressive",
                                            e.get("acceptance") != "paper", e["num_orders"])):
        metric = "–" if e.get("metric_name") is None else f"{e['metric_name']} {e['metric_value']:.3f}"
        rows.append([
            e["model"], rule_label(e), f"{e['iterations_mean']:.1f} ± {e['iterations_std']:.1f}",
            e["forward_calls"], e["accepted_per_iter"], fmt(e["ar_iterations"] / e["iterations_mean"], 1) + "×",
            metric, e["n_sequences"],
        ])
    return table(["model", "strategy", "iterations / sequence", "model forward calls", "tokens / iteration",
                  "fewer steps than AR", "validity", "sequences"], rows)


def throughput_table(entries: list[dict]) -> str:
    groups = defaultdict(dict)
    for e in entries:
        groups[(e["model"], e["new_tokens"], e["batch_size"])][rule_label(e)] = e
    rows = []
    for key in sorted(groups):
        ar = groups[key].get("autoregressive")
        for label, e in sorted(groups[key].items(), key=lambda kv: kv[0] != "autoregressive"):
            speed = e["tokens_per_s"] / ar["tokens_per_s"] if ar else None
            flops = e["flops_per_seq"] / ar["flops_per_seq"] if ar else None
            rows.append([
                e["model"], e["new_tokens"], e["batch_size"], label, e["tokens_per_s"],
                fmt(speed) + "×" if speed else "–", e["forward_calls"], fmt(e.get("iterations_mean"), 1),
                f"{e['flops_per_seq'] / 1e9:.2f} / {e['flops_per_seq_executed'] / 1e9:.2f}",
                fmt(flops, 1) + "×" if flops else "–", e["achieved_gflops_per_s"],
            ])
    return table(["model", "new tokens", "batch", "strategy", "tokens/s", "vs AR", "forward calls",
                  "iterations / seq", "GFLOP / sequence (algorithmic / executed)", "FLOPs vs AR",
                  "achieved GFLOP/s"], rows)


def orders_table(entries: list[dict]) -> str:
    rows = []
    key = (lambda e: (_rank(e["task"]), e["pos_encoding"], e["order"]))
    for e in sorted(entries, key=key):
        best = min(c["val_loss_random"] for c in e["curve"])
        rows.append([e["task"], e["pos_encoding"], e["order"], e["final"]["val_loss_random"], best,
                     e["final"]["val_loss_l2r"], f"{e['preset']}, T={e['seq_len']}, {e['steps']} steps"])
    return table(["task", "position encoding", "training order", "random-order val loss", "best",
                  "l2r val loss", "budget"], rows)


def quality_label(e: dict) -> str:
    return f"S = {e['diffusion_steps']}" if e["strategy"] == "diffusion" else rule_label(e)


def _quality_rank(e: dict) -> tuple:
    return (_rank(e["task"]), list(FAMILY_LABELS).index(e["family"]), e["steps_mean"])


def steps_quality_table(entries: list[dict]) -> str:
    rows = []
    for e in sorted(entries, key=_quality_rank):
        lo, hi = e["metric_ci95"]
        rows.append([e["task"], FAMILY_LABELS[e["family"]], quality_label(e), fmt(e["steps_mean"], 1),
                     f"{e['metric_name']} {e['metric_value']:.3f}", f"[{lo:.3f}, {hi:.3f}]", e["n_sequences"]])
    return table(["task", "family", "method", "mean steps", "metric", "95% CI (Wilson)", "n"], rows)


def other_table(benchmarks: list[dict]) -> str:
    rows = []
    for b in benchmarks:
        info = b.get("extra_info", {})
        if info.get("kind") in MY_KINDS:
            continue
        shown = ", ".join(f"{k}={fmt(v)}" for k, v in info.items() if isinstance(v, (int, float, str)))
        rows.append([b["name"], b["stats"]["mean"] * 1e3, shown])
    return table(["benchmark", "mean ms", "figures"], rows) if rows else ""


def small_sample_note(entries: list[dict], minimum: int = 1000) -> list[str]:
    """Markdown lines flagging a table whose figures come from fewer than ``minimum`` sequences (a budget run)."""
    n = min((e["n_sequences"] for e in entries if "n_sequences" in e), default=None)
    if n is None or n >= minimum:
        return []
    return [f"(Budget run: {n} sequences per row, below the {minimum} that quality figures need; "
            f"`SIGMAFAST_BENCH_SAMPLES={minimum}` sets them.)", ""]


def device_title(machine: dict) -> str:
    device = machine.get("sigmafast_device", machine.get("cpu", {}).get("brand_raw", "unknown device"))
    threads = machine.get("torch_threads")
    return f"{device} (torch threads: {threads})" if threads and device.startswith("CPU") else device


def markdown(machine: dict, benchmarks: list[dict]) -> str:
    parts = [f"### {device_title(machine)}", ""]
    sections = [
        ("Steps: exact oracles", oracle_table, by_kind(benchmarks, "oracle_steps")),
        ("Steps: small trained models", model_table, by_kind(benchmarks, "model_steps")),
        ("Throughput", throughput_table, by_kind(benchmarks, "throughput")),
        ("Orders and position encodings (validation loss, nats/token)", orders_table, by_kind(benchmarks, "orders")),
        ("Steps against quality: σ-GPT against diffusion (same backbone and budget)", steps_quality_table,
         by_kind(benchmarks, "steps_quality")),
    ]
    for title, fn, entries in sections:
        if entries:
            parts += [f"#### {title}", "", fn(entries), ""] + small_sample_note(entries)
    other = other_table(benchmarks)
    if other:
        parts += ["#### Other benchmarks (kernels)", "", other, ""]
    return "\n".join(parts)


def _vlines(ax, e: dict) -> None:
    ax.axvline(e["ar_iterations"], color="grey", ls=":", lw=1, label="autoregressive")
    if e.get("theory_iterations") is not None:
        ax.axvline(e["theory_iterations"], color="tab:green", ls="--", lw=1, label="theory")
    if e.get("paper_iterations") is not None:
        lo = e["paper_iterations"] - (e.get("paper_iterations_std") or 0)
        hi = e["paper_iterations"] + (e.get("paper_iterations_std") or 0)
        ax.axvline(e["paper_iterations"], color="tab:red", ls="--", lw=1, label="paper")
        if hi > lo:
            ax.axvspan(lo, hi, color="tab:red", alpha=0.1)
    if e.get("sim_iterations") is not None:
        ax.axvline(e["sim_iterations"], color="tab:purple", ls="-.", lw=1, label="simulation (5 orders)")
    if e.get("sim_lossless_iterations") is not None:
        ax.axvline(e["sim_lossless_iterations"], color="tab:orange", ls="-.", lw=1, label="simulation (lossless)")


def _steps_panel(ax, entries: list[dict], title: str) -> None:
    burst = [e for e in entries if e["strategy"] == "burst"]
    paper = sorted((e for e in burst if e["acceptance"] == "paper"), key=lambda e: e["num_orders"])
    if paper:
        xs = [e["iterations_mean"] for e in paper]
        ys = [e["metric_value"] for e in paper]
        ax.errorbar(xs, ys, xerr=[e["iterations_std"] for e in paper], marker="o", capsize=2,
                    color="tab:blue", label="burst, paper rule")
        for e, x, y in zip(paper, xs, ys):
            ax.annotate(f"{e['num_orders']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for e in burst:
        if e["acceptance"] == "lossless":
            ax.errorbar([e["iterations_mean"]], [e["metric_value"]], xerr=[e["iterations_std"]], marker="s",
                        capsize=2, color="tab:orange", ls="none", label="burst, lossless")
    for e in entries:
        if e["strategy"] == "autoregressive":
            ax.plot([e["iterations_mean"]], [e["metric_value"]], marker="^", color="black", ls="none",
                    label="autoregressive (model)")
    if entries:
        _vlines(ax, entries[0])
        metric = entries[0]["metric_name"]
        ax.set_ylabel(metric)
        if metric == "ones_rate":
            ax.axhline(0.1, color="grey", lw=1, ls="-", label="data rate 0.1")
            ax.set_ylim(0.0, 0.25)
        else:
            ax.set_ylim(-0.05, 1.05)
    ax.set_xscale("log")
    ax.set_xlabel("iterations per sequence (model evaluations)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _ordered(names: set) -> list[str]:
    """The paper's task order first (product, step, permutation, maze, char), then the rest."""
    known = [n for n in TASK_ORDER if n in names]
    return known + sorted(names - set(known))


def plot(benchmarks: list[dict], machine: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit('plot_benchmarks: matplotlib is not installed; run  pip install -e ".[plot]"  (or use --markdown)')
    written = []
    oracles = by_kind(benchmarks, "oracle_steps")
    models = [e for e in by_kind(benchmarks, "model_steps") if e.get("metric_name") is not None]
    panels = [("oracle", t, [e for e in oracles if e["task"] == t]) for t in _ordered({e["task"] for e in oracles})]
    panels += [("model", m, [e for e in models if e["model"] == m]) for m in _ordered({e["model"] for e in models})]
    if panels:
        cols = 3
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
        for ax, (kind, name, entries) in zip(axes.flat, panels):
            _steps_panel(ax, entries, f"{name} ({'exact oracle' if kind == 'oracle' else 'small model'})")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        written.append(_save(plt, fig, f"Validity vs burst iterations — {device_title(machine)}",
                             out_dir / "steps.png"))
    tp = by_kind(benchmarks, "throughput")
    if tp:
        groups = sorted({(e["model"], e["new_tokens"], e["batch_size"]) for e in tp})
        labels = sorted({rule_label(e) for e in tp}, key=lambda s: (s != "autoregressive", s))
        fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups)), 3.6))
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            vals = []
            for g in groups:
                match = [e["tokens_per_s"] for e in tp
                         if (e["model"], e["new_tokens"], e["batch_size"]) == g and rule_label(e) == label]
                vals.append(match[0] if match else 0.0)
            ax.bar([j + i * width for j in range(len(groups))], vals, width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels([f"{m}\n{n} tok, batch {b}" for m, n, b in groups], fontsize=8)
        ax.set_ylabel("generated tokens / s")
        ax.set_yscale("log")
        ax.set_title(f"Throughput — {device_title(machine)}", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        written.append(out_dir / "throughput.png")
        fig.savefig(written[-1], dpi=80)
        plt.close(fig)
    orders = by_kind(benchmarks, "orders")
    if orders:
        written.append(_plot_orders(plt, orders, machine, out_dir / "orders.png"))
    quality = by_kind(benchmarks, "steps_quality")
    if quality:
        written.append(_plot_steps_quality(plt, quality, machine, out_dir / "steps_quality.png"))
    return written


def _plot_steps_quality(plt, entries: list[dict], machine: dict, path: Path) -> Path:
    """Per task: metric (95% Wilson CI) against mean steps, one line per method family; σ-GPT and
    oracle lines join AR and the paper-rule bursts, lossless bursts are squares."""
    tasks = _ordered({e["task"] for e in entries})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for i, family in enumerate(FAMILY_LABELS):
            points = sorted((e for e in entries if e["task"] == task and e["family"] == family),
                            key=lambda e: e["steps_mean"])
            lossless = [e for e in points if e.get("acceptance") == "lossless"]
            line = [e for e in points if e not in lossless]
            for group, style in ((line, dict(marker="o")), (lossless, dict(marker="s", ls="none"))):
                if group:
                    ys = [e["metric_value"] for e in group]
                    err = [[y - e["metric_ci95"][0] for e, y in zip(group, ys)],
                           [e["metric_ci95"][1] - y for e, y in zip(group, ys)]]
                    ax.errorbar([e["steps_mean"] for e in group], ys, yerr=err, capsize=2, color=f"C{i}",
                                label=FAMILY_LABELS[family] + (" lossless" if group is lossless else ""), **style)
        first = next(e for e in entries if e["task"] == task)
        ax.set_xscale("log")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("mean model steps per sequence")
        ax.set_ylabel(first["metric_name"])
        ax.set_title(f"{task} (T={first['seq_len']}, n={first['n_sequences']} per point)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return _save(plt, fig, f"Quality against steps — {device_title(machine)}", path)


def _plot_orders(plt, entries: list[dict], machine: dict, path: Path) -> Path:
    """Per task: random-order (solid) and l2r (dashed) validation loss against steps, one colour per run."""
    tasks = _ordered({e["task"] for e in entries})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        runs = sorted((e for e in entries if e["task"] == task), key=lambda e: (e["pos_encoding"], e["order"]))
        for i, e in enumerate(runs):
            colour = f"C{i % 10}"
            steps = [c["iter"] for c in e["curve"]]
            label = f"{e['pos_encoding']}, {e['order']}"
            ax.plot(steps, [c["val_loss_random"] for c in e["curve"]], color=colour, label=label + " (random)")
            ax.plot(steps, [c["val_loss_l2r"] for c in e["curve"]], color=colour, ls="--", lw=1)
        ax.set_xlabel("training steps")
        ax.set_ylabel("validation loss (nats/token); dashed: left-to-right")
        ax.set_title(f"{task} ({runs[0]['preset']}, T={runs[0]['seq_len']})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return _save(plt, fig, f"Training orders and position encodings — {device_title(machine)}", path)


def _save(plt, fig, title: str, path: Path) -> Path:
    """Title, lay out, write and close a figure."""
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="pytest-benchmark JSON (--benchmark-json=PATH)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="where the .png figures go")
    parser.add_argument("--markdown", action="store_true", help="print the RESULTS.md tables instead of plotting")
    args = parser.parse_args(argv)
    if not args.json.is_file():
        parser.error(f"{args.json} does not exist; run pytest benchmarks/ --benchmark-only --benchmark-json=PATH")
    try:
        machine, benchmarks = load(args.json)
    except ValueError as e:  # json.JSONDecodeError included
        parser.error(f"{args.json}: {e}")
    if args.markdown:
        print(markdown(machine, benchmarks))
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for path in plot(benchmarks, machine, args.out_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
