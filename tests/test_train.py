import logging
import math
from pathlib import Path

import pytest
import torch

import sigmafast.train as train_mod
from sigmafast.checkpoint import read_checkpoint
from sigmafast.model import SigmaGPT, SigmaGPTConfig
from sigmafast.tasks import get_task
from sigmafast.train import (
    TrainConfig, build_model_config, load_checkpoint, train,
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


def test_a_huge_max_iters_logs_a_bounded_eta(tmp_path, monkeypatch, caplog):
    """--max-iters passes validation at any size: an eta past what timedelta holds is logged capped, not an
    OverflowError after the first step (the run here stops after it, as after a SIGINT during it)."""
    step = train_mod._Trainer.step

    def step_then_stop(self, it):
        self.stop.requested = True
        return step(self, it)

    monkeypatch.setattr(train_mod._Trainer, "step", step_then_stop)
    with caplog.at_level(logging.INFO, logger="sigmafast.train"):
        result = train(small_cfg(tmp_path, max_iters=10**20))
    assert result.interrupted and read_checkpoint(tmp_path / "ckpt.pt")["iter"] == 1
    assert "iter 0/100000000000000000000 |" in caplog.text and "eta 999999999 days, 0:00:00" in caplog.text


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


def test_validity_sampling_memory_is_checked_for_the_path_it_takes(monkeypatch):
    """Each evaluation's validity sampling is checked before training starts, naming its flag; off CUDA it runs
    the reference path, whose estimate counts the attention's scores (larger here than the Triton path's)."""
    from sigmafast import memory
    from sigmafast.kernels import row_blocks

    cfg = resolve(TrainConfig(task="step", preset="tiny", num_eval_samples=64), 100)
    model_config = SigmaGPTConfig(vocab_size=5, block_size=100, n_layer=1, n_head=2, n_embd=16)
    cpu = torch.device("cpu")
    reference = memory.sampling_peak_bytes(model_config, 64, 1, 100, 4, row_blocks.block_elements(cpu))
    assert reference > memory.sampling_peak_bytes(model_config, 64, 1, 100, 4)
    monkeypatch.setattr(memory, "SAMPLING_CHECK_FLOOR", 0)
    monkeypatch.setattr(memory, "available_bytes", lambda device: reference - 1)
    message = r"sampling 64 sequences of 100 tokens .* reduce TrainConfig.num_eval_samples \(0 disables"
    with pytest.raises(ValueError, match=message):
        train_mod.check_memory(cfg, model_config, 100, cpu)
