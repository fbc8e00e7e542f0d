import logging
import math
from pathlib import Path

import pytest
import torch

import sigmafast.train as train_mod
from sigmafast.batches import get_batch
from sigmafast.checkpoint import read_checkpoint
from sigmafast.kernels import row_blocks
from sigmafast.loss import step_weights
from sigmafast.model import SigmaGPT, SigmaGPTConfig
from sigmafast.tasks import get_task
from sigmafast.train import (
    TrainConfig, build_model_config, configure_optimizer, learning_rate, load_checkpoint, train,
)
from sigmafast import train_config
from sigmafast.train_config import resolve
from helpers import BASE_ARGV, small_cfg, train_script as load_script

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
@pytest.mark.parametrize(
    "task,kw,min_drop",
    [
        ("step", {}, 0.5),  # T=100: from ~ln 3 to about the per-token entropy of the data
        ("permutation", {"seq_len": 8, "pos_encoding": "learned"}, 0.5),  # below ln 8: learns exclusion
    ],
    ids=["step-T100", "permutation-T8"],
)
def test_training_lowers_random_order_val_loss(tmp_path, task, kw, min_drop):
    cfg = TrainConfig(task=task, preset="tiny", max_iters=300, batch_size=16, eval_interval=300, eval_iters=4,
                      log_interval=100, num_eval_samples=0, out_dir=str(tmp_path), **kw)
    result = train(cfg)
    first, last = result.history[0], result.history[-1]
    assert (first["iter"], last["iter"]) == (0, 300)
    assert last["val_loss_random"] < first["val_loss_random"] - min_drop, result.history
    if task == "permutation":
        assert last["val_loss_random"] < math.log(8) - 0.3, "no better than uniform over the unseen classes"
    assert math.isclose(last["val_ppl_l2r"], math.exp(last["val_loss_l2r"]))


def test_estimated_peak_memory_is_logged_at_start(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="sigmafast.train")
    train(small_cfg(tmp_path, max_iters=1))
    lines = [r.getMessage() for r in caplog.records if "estimated peak memory" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("GiB per process"), lines


def test_curriculum_logs_linearly_falling_l2r_fraction(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="sigmafast.train"):
        result = train(small_cfg(tmp_path, order="curriculum", curriculum_start=0.5, max_iters=10))
    fractions = [e["l2r_fraction"] for e in result.train_log]
    assert [e["iter"] for e in result.train_log] == list(range(10))
    expected = [0.5 * (1 - it / 10) for it in range(10)]
    assert fractions == pytest.approx(expected, abs=1e-12)
    steps = [b - a for a, b in zip(fractions, fractions[1:])]
    assert steps == pytest.approx([-0.05] * 9)
    assert "l2r 0.500" in caplog.text and "l2r 0.050" in caplog.text


def test_log_lines(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="sigmafast.train"):
        train(small_cfg(tmp_path, max_iters=3))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("iter ")]
    assert len(lines) == 3
    for part in ("loss ", "lr ", "tok/s", "eta "):
        assert part in lines[0]
    assert any("val loss random" in r.getMessage() and "(ppl" in r.getMessage() for r in caplog.records)


def test_validity_metric_from_sampled_sequences(tmp_path, monkeypatch):
    import sigmafast.sampler

    valid = get_task("step", seq_len=12).sample_batch(4, "val", torch.Generator().manual_seed(0))
    outs = iter([valid, torch.zeros_like(valid)])  # all-zero step rows are invalid
    monkeypatch.setattr(sigmafast.sampler, "generate", lambda *a, **k: next(outs))
    result = train(small_cfg(tmp_path, task="step", seq_len=12, max_iters=2, eval_interval=2, num_eval_samples=4))
    assert [r["sample_valid"] for r in result.history] == [1.0, 0.0]


def test_unwritable_out_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="out_dir"):
        train(small_cfg(tmp_path, out_dir=str(blocker / "run")))
    with pytest.raises(ValueError, match=f"TrainConfig.out_dir '{blocker}' is a file, not a folder$"):
        train(small_cfg(tmp_path, out_dir=str(blocker)))


def unwritable_dir(tmp_path) -> Path:
    """An existing folder this process cannot create a file in: a read-only temporary folder, or, for root
    (whom permissions do not stop), a sysfs or procfs folder."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    for folder in (ro, Path("/sys/kernel"), Path("/proc/self")):
        if not folder.is_dir():
            continue
        try:
            (folder / ".probe").open("xb").close()
        except OSError:
            return folder
        (folder / ".probe").unlink()
    pytest.skip("no folder this process cannot write to (root, without /sys or /proc)")


def test_unwritable_out_dir_fails_at_start(tmp_path, monkeypatch, capsys):
    folder = unwritable_dir(tmp_path)

    def step(self, it):
        raise AssertionError(f"trained (iter {it}) with an unwritable out_dir")

    monkeypatch.setattr(train_mod._Trainer, "step", step)
    with pytest.raises(ValueError, match=f"TrainConfig.out_dir '{folder}' is not writable: \\[Errno"):
        train(small_cfg(folder))
    assert load_script().main(BASE_ARGV + ["--out-dir", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out-dir '{folder}' is not writable: ") and err.count("\n") == 1, err
    assert not (folder / "ckpt.pt").exists()
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".write-test")]


def test_char_recipe_order_is_dropped_for_diffusion_and_unused_eval_samples_are_an_error(tmp_path, capsys):
    """The char recipe's curriculum order does not apply to --objective diffusion (an explicit --order does,
    and is an error); --num-eval-samples N > 0 on a task without a validity metric is an error, not ignored."""
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 40)
    char = ["--task", "char", "--text", str(text), "--seq-len", "8", "--max-iters", "1", "--batch-size", "4",
            "--eval-iters", "1"]
    script = load_script()
    assert script.main(char + ["--objective", "diffusion", "--out-dir", str(tmp_path / "d")]) == 0
    assert read_checkpoint(tmp_path / "d" / "ckpt.pt")["train_config"]["order"] == "random"
    assert resolve(TrainConfig(task="char", curriculum_start=0.3), 8).order == "curriculum"  # the recipe's
    assert script.main(char + ["--objective", "diffusion", "--order", "curriculum"]) == 2
    assert "--order ('curriculum') applies to objective 'sigma' only" in capsys.readouterr().err
    assert script.main(char + ["--num-eval-samples", "4", "--out-dir", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --num-eval-samples (4) needs a task with a validity metric, and task 'char' "
                   "has none: pass 0 or leave it out\n")
    assert not (tmp_path / "n" / "ckpt.pt").exists()


def test_every_micro_step_draws_its_own_batch():
    """A micro-batch is a pure function of (seed, step, micro-step index): the same arguments draw it again, and
    another micro-step of the same step, another step or another seed draws another batch (else the micro-steps
    of grad_accum, and DDP's ranks, would train on copies of one batch)."""
    task = get_task("permutation", seq_len=12)
    cfg = resolve(small_cfg("unused"), task.seq_len)
    start_pos = build_model_config(cfg, task).start_pos

    def tokens(step, index, seed=cfg.seed):
        c = cfg if seed == cfg.seed else resolve(small_cfg("unused", seed=seed), task.seq_len)
        return get_batch(task, c, step, index, start_pos, torch.device("cpu"))[0]

    assert torch.equal(tokens(3, 1), tokens(3, 1))
    drawn = [tokens(3, 0), tokens(3, 1), tokens(4, 0), tokens(4, 1), tokens(3, 0, seed=cfg.seed + 1)]
    for i, a in enumerate(drawn):
        for b in drawn[i + 1:]:
            assert not torch.equal(a, b)


def test_curriculum_batches_follow_the_scheduled_left_to_right_share():
    """Order "curriculum" trains on the share of left-to-right rows that its schedule (and the logged l2r
    fraction) gives the step: all 8 rows from curriculum_start 1 at step 0, 4 at half-way, none at
    curriculum_iters."""
    task = get_task("permutation", seq_len=12)
    cfg = resolve(small_cfg("unused", order="curriculum", curriculum_start=1.0, curriculum_iters=4), task.seq_len)
    start_pos = build_model_config(cfg, task).start_pos

    def l2r_rows(step):
        out_pos = get_batch(task, cfg, step, 0, start_pos, torch.device("cpu"))[2]
        return int((out_pos == torch.arange(task.seq_len)).all(dim=1).sum())

    assert [l2r_rows(step) for step in (0, 2, 4)] == [8, 4, 0]


def test_grad_clip_bounds_the_update_and_leaves_small_gradients_alone(tmp_path):
    """--grad-clip far above the gradients' norm trains exactly as no clipping (0); a tiny one changes the run."""
    kw = dict(max_iters=3, eval_interval=3)
    runs = {clip: train(small_cfg(tmp_path / str(clip), grad_clip=clip, **kw)).model for clip in (0.0, 1e9, 1e-4)}
    for p, q, r in zip(*(m.parameters() for m in runs.values())):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, r) for p, r in zip(runs[0.0].parameters(), runs[1e-4].parameters()))


@pytest.mark.parametrize("objective", ["sigma", "diffusion"])
def test_training_never_holds_more_than_one_chunk_of_logits(objective, tmp_path, monkeypatch):
    """The training loss is chunked (sigmafast.loss): with CPU chunks of 5 rows of logits, no tensor that a
    training run allocates (its steps, their backward and its evaluations) holds the logits of more rows, where
    a micro-batch has 8 x 12 = 96."""
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = small_cfg(tmp_path, task="random_walk", objective=objective, max_iters=2, eval_interval=2)
    task = get_task("random_walk", seq_len=12)
    V = build_model_config(resolve(cfg, task.seq_len), task).vocab_size  # 153 or 154: no other dimension's size
    monkeypatch.setattr(row_blocks, "CPU_BLOCK_ELEMENTS", 5 * V)
    rows = []

    class LogitRows(TorchDispatchMode):
        """The rows of every newly allocated tensor whose last dimension is the vocabulary (not the views, such as
        the LM head's transpose, nor the in-place results)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            rows.extend(t.numel() // V for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                        and t.dim() and t.shape[-1] == V and t.untyped_storage().data_ptr() not in inputs)
            return out

    with LogitRows():
        train(cfg)
    assert rows and max(rows) == 5


def test_derived_lr_decay_covers_the_warm_up():
    """Unset, lr_decay_iters is max_iters, or the warm-up of a shorter run (the same schedule: all warm-up)."""
    assert resolve(TrainConfig(task="step", max_iters=300), 12).lr_decay_iters == 300
    assert resolve(TrainConfig(task="step", max_iters=10), 12).lr_decay_iters == 50  # the tiny preset's warm-up


def test_learning_rate_schedule():
    cfg = resolve(TrainConfig(lr=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200), 12)
    assert learning_rate(0, cfg) == pytest.approx(1 / 11)
    assert learning_rate(9, cfg) == pytest.approx(10 / 11)
    assert learning_rate(10, cfg) == pytest.approx(1.0)
    assert learning_rate(60, cfg) == pytest.approx(0.55)
    assert learning_rate(110, cfg) == pytest.approx(0.1) and learning_rate(150, cfg) == pytest.approx(0.1)
    lrs = [learning_rate(i, cfg) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_weight_decay_only_on_matrices():
    cfg = resolve(TrainConfig(task="step"), 12)
    model = SigmaGPT(build_model_config(cfg, get_task("step", seq_len=12)))
    opt = configure_optimizer(model, cfg, torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_lr_scales_group_the_embedding_and_final_norm():
    cfg = resolve(TrainConfig(task="step", embedding_lr_scale=0.5, final_norm_lr_scale=10.0), 12)
    model = SigmaGPT(build_model_config(cfg, get_task("step", seq_len=12)))
    groups = {(g["weight_decay"], g["lr_scale"]): g["params"] for g in configure_optimizer(
        model, cfg, torch.device("cpu")).param_groups}
    assert set(groups) == {(0.1, 1.0), (0.0, 1.0), (0.1, 0.5), (0.0, 10.0)}
    assert groups[(0.1, 0.5)] == [model.lm_head.weight] and groups[(0.0, 10.0)] == [model.ln_f.weight, model.ln_f.bias]
    assert sum(len(ps) for ps in groups.values()) == len(list(model.parameters()))


def test_zero_embedding_lr_scale_freezes_the_embedding(tmp_path):
    cfg = small_cfg(tmp_path, embedding_lr_scale=0.0, max_iters=3, seed=5)
    torch.manual_seed(cfg.seed)
    initial = SigmaGPT(build_model_config(resolve(cfg, 12), get_task("permutation", seq_len=12)))
    trained = train(cfg).model
    torch.testing.assert_close(trained.wte.weight, initial.wte.weight, rtol=0, atol=0)
    assert not torch.equal(trained.ln_f.weight, initial.ln_f.weight)


def test_step_weights():
    assert step_weights("uniform", 5) is None
    torch.testing.assert_close(step_weights("visited", 4), torch.tensor([0.25, 0.75, 1.25, 1.75]))
    assert step_weights("visited", 1).tolist() == [1.0]
    with pytest.raises(ValueError, match="loss weighting must be one of"):
        step_weights("late", 4)


def test_visited_loss_weighting_weights_each_step(tmp_path, monkeypatch):
    """The trainer hands the model the (T,) step weights with every batch, and they change the update."""
    seen = []
    real_loss = SigmaGPT.loss

    def spy(self, *batch):
        if self.training:  # the training steps, not the (unweighted) validation losses
            seen.append(batch[4] if len(batch) > 4 else None)
        return real_loss(self, *batch)

    monkeypatch.setattr(SigmaGPT, "loss", spy)
    weighted = train(small_cfg(tmp_path / "w", loss_weighting="visited", max_iters=2, seed=3)).model
    assert len(seen) == 2 and all(torch.equal(w, step_weights("visited", 12)) for w in seen)
    seen.clear()
    plain = train(small_cfg(tmp_path / "u", loss_weighting="uniform", max_iters=2, seed=3)).model
    assert seen == [None, None]
    assert not torch.equal(weighted.wte.weight, plain.wte.weight)
    assert resolve(TrainConfig(task="step"), 12).loss_weighting == "uniform"  # no recipe weighting
    assert resolve(small_cfg(tmp_path), 12).loss_weighting == "visited"  # the permutation recipe's
    assert resolve(small_cfg(tmp_path, objective="diffusion"), 12).loss_weighting == "uniform"


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-medium"])
def test_paper_recipe(preset):
    cfg = resolve(TrainConfig(task="owt", preset=preset), seq_len=1024, world_size=8)
    assert (cfg.lr, cfg.min_lr, cfg.warmup_iters, cfg.weight_decay) == (6e-4, 6e-5, 2000, 0.1)
    assert (cfg.beta1, cfg.beta2, cfg.grad_clip, cfg.dtype) == (0.9, 0.95, 1.0, "auto")
    assert cfg.lr_decay_iters == cfg.max_iters
    tokens = cfg.batch_size * cfg.grad_accum * 1024
    assert 0.45e6 < tokens < 0.55e6 and cfg.grad_accum % 8 == 0
    assert resolve(TrainConfig(task="owt", preset=preset, grad_accum=4, lr=1e-4), 1024).lr == 1e-4


def test_default_grad_accum_gives_every_rank_a_micro_step():
    assert resolve(TrainConfig(), 12, world_size=1).grad_accum == 1
    assert resolve(TrainConfig(), 12, world_size=4).grad_accum == 4


def test_grad_accum_must_split_across_ranks():
    with pytest.raises(ValueError, match="grad_accum \\(3\\) must be divisible by the number of DDP ranks \\(2\\)"):
        resolve(TrainConfig(grad_accum=3), 12, world_size=2)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(task="nope"), ValueError, "TrainConfig.task: unknown task 'nope'"),
        (dict(preset="huge"), ValueError, "TrainConfig.preset: unknown preset 'huge'"),
        (dict(order="zigzag"), ValueError, "TrainConfig.order: unknown order 'zigzag'"),
        (dict(n_embd=60, n_head=4), ValueError, "n_embd \\(60\\) must be divisible by 2\\*n_head \\(8\\)"),
        (dict(task="product", n_head=3), ValueError, "n_embd \\(64\\) must be divisible by 2\\*n_head \\(6\\)"),
        (dict(max_iters=1.5), TypeError, "TrainConfig.max_iters must be int or None"),
        (dict(compile="yes"), TypeError, "TrainConfig.compile must be bool"),
        (dict(lr=0.0), ValueError, "TrainConfig.lr must be > 0"),
        (dict(batch_size=0), ValueError, "TrainConfig.batch_size must be >= 1"),
        (dict(beta2=1.0), ValueError, "TrainConfig.beta2 must be in"),
        (dict(curriculum_start=2.0), ValueError, "TrainConfig.curriculum_start must be in"),
        (dict(lr=1e-3, min_lr=1e-2), ValueError, "min_lr"),
        (dict(dtype="float16"), ValueError, "TrainConfig.dtype"),
        (dict(device="tpu"), ValueError, "TrainConfig.device"),
        (dict(device="cuda:x"), ValueError, "TrainConfig.device"),
        (dict(pos_encoding="alibi"), ValueError, "TrainConfig.pos_encoding"),
        (dict(seq_len=0), ValueError, "TrainConfig.seq_len must be >= 1"),
        (dict(embedding_init="xavier"), ValueError, "TrainConfig.embedding_init"),
        (dict(embedding_lr_scale=-1.0), ValueError, "TrainConfig.embedding_lr_scale must be >= 0"),
        (dict(final_norm_lr_scale="2"), TypeError, "TrainConfig.final_norm_lr_scale must be"),
        (dict(loss_weighting="late"), ValueError, "TrainConfig.loss_weighting"),
        (dict(mlp_ratio=-1), ValueError, "TrainConfig.mlp_ratio must be >= 0"),
        (dict(mlp_ratio=0.5), TypeError, "TrainConfig.mlp_ratio must be"),
        (dict(final_norm="rms"), ValueError, "TrainConfig.final_norm"),
        (dict(loss_weighting="visited", objective="diffusion"), ValueError, "applies to objective 'sigma' only"),
        (dict(warmup_iters=10, lr_decay_iters=5), ValueError,
         "TrainConfig.lr_decay_iters \\(5\\) must be >= warmup_iters \\(10\\)"),
        *[(dict(**{name: value}), ValueError, f"TrainConfig.{name} must be a finite number, got {value}")
          for name, value in (("lr", math.nan), ("lr", math.inf), ("min_lr", math.nan), ("weight_decay", math.nan),
                              ("grad_clip", math.nan), ("grad_clip", math.inf), ("embedding_lr_scale", math.nan),
                              ("final_norm_lr_scale", math.inf), ("beta1", math.nan), ("dropout", math.nan),
                              ("curriculum_start", math.nan))],
    ],
    ids=["task", "preset", "order", "n_embd", "n_head", "int-type", "bool-type", "lr", "batch", "beta2",
         "curriculum", "min_lr", "dtype", "device", "cuda-index", "pos-encoding", "seq-len", "embedding-init",
         "embedding-lr-scale", "norm-lr-scale-type", "loss-weighting", "mlp-ratio", "mlp-ratio-type", "final-norm",
         "loss-weighting-diffusion", "lr-decay-below-warmup", "nan-lr", "inf-lr", "nan-min-lr", "nan-weight-decay",
         "nan-grad-clip", "inf-grad-clip", "nan-embedding-lr-scale", "inf-final-norm-lr-scale", "nan-beta1",
         "nan-dropout", "nan-curriculum-start"],
)
def test_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainConfig(**kwargs)


def test_train_input_errors(tmp_path):
    with pytest.raises(TypeError, match="cfg must be a TrainConfig"):
        train({"task": "permutation"})
    with pytest.raises(ValueError, match="block_size \\(10\\) must be >= the task's seq_len \\(12\\)"):
        train(small_cfg(tmp_path, block_size=10))
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*ckpt.pt"):
        train(small_cfg(tmp_path / "empty", resume=True))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


def test_task_recipes_fill_only_unset_fields(monkeypatch):
    cfg = resolve(TrainConfig(task="char"), seq_len=256)
    assert (cfg.pos_encoding, cfg.order, cfg.curriculum_start) == ("rope-v", "curriculum", 0.5)
    mine = resolve(TrainConfig(task="char", pos_encoding="learned", order="random"), seq_len=256)
    assert (mine.pos_encoding, mine.order) == ("learned", "random")
    assert resolve(TrainConfig(task="product"), seq_len=100).pos_encoding is None  # no recipe: the model default
    assert resolve(TrainConfig(task="vertical_rate"), seq_len=64).pos_encoding == "rope-v"
    recipe = dict(preset="small", n_embd=96, max_iters=77, pos_encoding="rope", order="fractal")
    monkeypatch.setitem(train_config.TASK_RECIPES, "maze", recipe)
    cfg = TrainConfig(task="maze")
    assert cfg.preset == "small" and cfg.architecture()["n_embd"] == 96
    assert resolve(cfg, seq_len=546).max_iters == 77
    other = TrainConfig(task="maze", preset="tiny")  # another preset: only the task-level fields apply
    assert other.architecture()["n_embd"] == 64 and other.architecture()["pos_encoding"] == "rope"
    resolved = resolve(other, seq_len=546)
    assert resolved.max_iters == train_config.TRAIN_PRESETS["tiny"]["max_iters"] and resolved.order == "fractal"


def test_evaluation_loops_stop_when_asked():
    """``should_stop`` is polled before every validation batch and every sampling step: a true answer
    abandons the evaluation with EvaluationStopped."""
    from sigmafast import diffusion, naive
    from sigmafast.diffusion import training as diffusion_training
    from sigmafast.evaluation import estimate_val_loss, sample_validity
    from sigmafast.signals import EvaluationStopped

    task = get_task("step", seq_len=12)
    cfg = resolve(small_cfg(".", task="step", seq_len=12, eval_iters=20), task.seq_len)
    torch.manual_seed(0)
    model = SigmaGPT(build_model_config(cfg, task)).eval()
    batches = train_mod.make_val_batches(task, cfg)

    def stop_at(n: int):
        polls = []

        def should_stop() -> bool:
            polls.append(None)
            return len(polls) > n
        return should_stop, polls

    args = (task.bos, torch.autocast("cpu", enabled=False), torch.device("cpu"))
    full = estimate_val_loss(model, batches, "random", *args)
    should_stop, polls = stop_at(len(batches))
    assert estimate_val_loss(model, batches, "random", *args, should_stop=should_stop) == full
    should_stop, polls = stop_at(3)
    with pytest.raises(EvaluationStopped):
        estimate_val_loss(model, batches, "l2r", *args, should_stop=should_stop)
    assert len(polls) == 4

    canvas = task.sample_batch(3, "val", torch.Generator().manual_seed(1))
    should_stop, polls = stop_at(5)
    with pytest.raises(EvaluationStopped):
        sample_validity(model, task, canvas, 0, "cpu", should_stop=should_stop)
    assert len(polls) == 6  # once before sampling, then after each sampling step
    assert sample_validity(model, task, canvas, 0, "cpu", should_stop=lambda: False) \
        == sample_validity(model, task, canvas, 0, "cpu")
    naive_samples = naive.generate(model, canvas, known=task.prompt_mask.expand(canvas.shape),
                                   strategy="autoregressive", generator=torch.Generator().manual_seed(0))
    assert sample_validity(model, task, canvas, 0, "cpu") == task.evaluate(naive_samples)  # the same tokens

    dmodel = diffusion.make_model(model.config, "diffusion", diffusion.DiffusionConfig(noise="absorbing"))
    xs = [x for x, _ in batches]
    should_stop, polls = stop_at(2)
    with pytest.raises(EvaluationStopped):
        diffusion_training.estimate_val_loss(dmodel, xs, torch.Generator().manual_seed(0), *args[1:],
                                             should_stop=should_stop)
    assert len(polls) == 3
    with pytest.raises(EvaluationStopped):
        sample_validity(dmodel, task, canvas, 0, "cpu", should_stop=lambda: True)


def test_task_flags_a_task_does_not_take_are_named_as_flags(tmp_path):
    cfg = TrainConfig(task="step", text="shakespeare.txt", csv="x.csv", max_iters=1, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"task 'step' does not take --text, --csv; of the task flags it takes "
                                         r"--seq-len$"):
        train(cfg)
    assert not (tmp_path / "ckpt.pt").exists()


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA L40S", 362e12), ("NVIDIA L40", 181e12), ("NVIDIA H200", 989e12)])
def test_mfu_uses_the_gpus_own_dense_bf16_peak(name, peak, monkeypatch):
    """The most specific name in the peak table wins (an H100 PCIe is not an SXM H100, an L40S not an L40);
    float32 training, the CPU and unknown GPUs get no estimate."""
    cfg = SigmaGPTConfig.from_preset("tiny", vocab_size=10, block_size=16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda")
    per_token = 6 * 1000 + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * 16
    assert train_mod.estimate_mfu(cfg, 1000, 16, 1e9, cuda) == pytest.approx(per_token * 1e9 / peak)
    assert train_mod.estimate_mfu(cfg, 1000, 16, 1e9, cuda, bf16=False) is None
    assert train_mod.estimate_mfu(cfg, 1000, 16, 1e9, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert train_mod.estimate_mfu(cfg, 1000, 16, 1e9, cuda) is None
