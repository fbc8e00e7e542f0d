"""The discrete-diffusion baseline in the trainer: its config fields, GPT-2 tokens, checkpoints and resume,
and a trained model's law."""

from __future__ import annotations

import math

import pytest
import torch

import sigmafast
from sigmafast import diffusion
from sigmafast.checkpoint import atomic_save, read_checkpoint
from sigmafast.diffusion import DiffusionConfig, DiffusionGPT
from sigmafast.diffusion.noise import NOISES, noisy_batch
from sigmafast.tasks import get_task
from sigmafast.train import TrainConfig, build_model_config, load_checkpoint, train


def diffusion_cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(task="product", seq_len=12, preset="tiny", objective="diffusion", batch_size=8, max_iters=4,
                warmup_iters=1, eval_interval=2, eval_iters=2, log_interval=1, num_eval_samples=4,
                out_dir=str(tmp_path))
    return TrainConfig(**{**base, **kw})


def test_train_config_objective_fields():
    with pytest.raises(ValueError, match="objective"):
        TrainConfig(objective="ddpm")
    with pytest.raises(ValueError, match="diffusion_noise"):
        TrainConfig(objective="diffusion", diffusion_noise="gaussian")
    with pytest.raises(ValueError, match="applies to objective 'sigma' only"):
        TrainConfig(objective="diffusion", order="left-to-right")
    assert TrainConfig().diffusion_config() is None
    assert TrainConfig(objective="diffusion", diffusion_noise="absorbing").diffusion_config().noise == "absorbing"


@pytest.mark.parametrize("noise", NOISES)
def test_gpt2_token_model_masks_with_an_id_of_its_own(noise):
    """GPT-2's BOS <|endoftext|> is a data token (it ends every document): a diffusion model of GPT-2 tokens
    masks with one more id, so a window holding <|endoftext|> has a finite loss and the token stays
    predictable."""
    task = get_task("owt", seq_len=16)  # opens no file
    cfg = TrainConfig(task="owt", seq_len=16, preset="tiny", objective="diffusion", diffusion_noise=noise)
    config = build_model_config(cfg, task)
    assert (config.vocab_size, config.bos_token_id) == (task.vocab_size + 1, task.vocab_size)
    sigma = build_model_config(TrainConfig(task="owt", seq_len=16, preset="tiny"), task)
    assert (sigma.vocab_size, sigma.bos_token_id) == (task.vocab_size, task.bos)
    torch.manual_seed(0)
    model = diffusion.make_model(config, "diffusion", cfg.diffusion_config()).eval()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, task.vocab_size, (4, 16), generator=g)
    x0[:, ::3] = task.bos
    batch = noisy_batch(x0, noise, config.vocab_size, model.mask_id, g)
    assert bool((batch.x_t != batch.x0).any()) and not bool((batch.x_t == task.vocab_size + 1).any())
    assert math.isfinite(model.loss(batch.x0, batch.x_t, batch.t).item())
    logits = model(batch.x_t, batch.t)  # (B, T, V + 1)
    assert bool(torch.isfinite(logits[..., task.bos]).all())
    assert bool((logits[..., model.mask_id] == float("-inf")).all())


@pytest.mark.parametrize("noise", NOISES)
def test_checkpoint_round_trip_and_wrong_objective(tmp_path, noise):
    result = train(diffusion_cfg(tmp_path, diffusion_noise=noise))
    assert [h["iter"] for h in result.history] == [0, 2, 4]
    assert {"val_loss_diffusion", "sample_ones_rate"} <= set(result.history[-1])
    ckpt = read_checkpoint(tmp_path / "ckpt.pt")
    assert ckpt["objective"] == "diffusion"
    assert ckpt["diffusion_config"] == {"noise": noise, "parameterization": "factored"}
    assert set(ckpt["best_val_loss"]) == {"diffusion"}
    model, task, cfg = load_checkpoint(tmp_path / "ckpt.pt")
    assert isinstance(model, DiffusionGPT) and model.noise == noise and not model.training
    assert cfg.objective == "diffusion" and task.name == "product"
    for (name, p), q in zip(model.state_dict().items(), result.model.state_dict().values()):
        assert torch.equal(p, q), name
    with pytest.raises(TypeError, match="sigmafast.diffusion.generate"):
        sigmafast.generate(model, torch.zeros(1, 0, dtype=torch.long), 12)
    with pytest.raises(ValueError, match="the checkpoint's run has objective 'diffusion', and a resumed run keeps it"):
        train(diffusion_cfg(tmp_path, objective="sigma", resume=True))
    resumed = train(diffusion_cfg(tmp_path, diffusion_noise=noise, max_iters=6, resume=True))
    assert [h["iter"] for h in resumed.history] == [0, 2, 4, 6]


def test_checkpoint_older_than_the_parameterization_resumes_as_plain(tmp_path):
    """A uniform-noise checkpoint written before DiffusionConfig.parameterization holds a "plain" model: it
    loads as one and resumes as one (no flag chooses the parameterization, so a resume keeps the stored one)."""
    train(diffusion_cfg(tmp_path, max_iters=2, num_eval_samples=0))
    path = tmp_path / "ckpt.pt"
    ckpt = read_checkpoint(path)
    del ckpt["diffusion_config"]["parameterization"]
    atomic_save(ckpt, path)
    assert load_checkpoint(path)[0].diffusion_config.parameterization == "plain"
    resumed = train(diffusion_cfg(tmp_path, max_iters=4, num_eval_samples=0, resume=True))
    assert resumed.model.diffusion_config == DiffusionConfig("uniform", "plain")
    assert read_checkpoint(path)["diffusion_config"] == {"noise": "uniform", "parameterization": "plain"}
    with pytest.raises(ValueError, match="objective: checkpoint 'diffusion'"):  # another noise is another model
        train(diffusion_cfg(tmp_path, diffusion_noise="absorbing", max_iters=6, resume=True))


def test_checkpoint_without_objective_loads_as_sigma(tmp_path):
    train(diffusion_cfg(tmp_path, objective="sigma", max_iters=2, num_eval_samples=0))
    path = tmp_path / "ckpt.pt"
    ckpt = read_checkpoint(path)
    assert ckpt["objective"] == "sigma" and ckpt["diffusion_config"] is None
    for key in ("objective", "diffusion_config"):
        del ckpt[key]
    del ckpt["train_config"]["objective"], ckpt["train_config"]["diffusion_noise"]
    atomic_save(ckpt, path)
    model, _, cfg = load_checkpoint(path)
    assert isinstance(model, sigmafast.SigmaGPT) and cfg.objective == "sigma"
    with pytest.raises(TypeError, match="needs a DiffusionGPT"):
        diffusion.generate(model, torch.zeros(1, 0, dtype=torch.long), 12)
    with pytest.raises(ValueError, match="the checkpoint's run has objective 'sigma', and a resumed run keeps it"):
        train(diffusion_cfg(tmp_path, resume=True))


@pytest.mark.slow
@pytest.mark.parametrize("noise", NOISES)
def test_trained_model_reproduces_the_product_ones_rate(tmp_path, noise):
    """A tiny model trained by ``train(objective="diffusion")`` on product (p = 0.1) samples 1000 rows
    whose ones-rate lies in the 99.9% confidence interval around 0.1 (rows are independent draws).

    Uniform noise needs the factored parameterisation: with the plain one this recipe's network
    missed the exact p(x_0 = 1 | x_t = 1) at t = 0.05 (0.8125) by up to 0.045, which alone moves
    the final step's ones-rate by about 0.008 (more training only changed the sign of the error)."""
    cfg = diffusion_cfg(tmp_path, seq_len=20, diffusion_noise=noise, batch_size=64, max_iters=400, warmup_iters=40,
                        min_lr=3e-5, eval_interval=400, log_interval=100, num_eval_samples=0)
    model = train(cfg).model
    N, T = 1000, 20
    out = diffusion.generate(model, torch.zeros(N, 0, dtype=torch.long), T, steps=T,
                             generator=torch.Generator().manual_seed(0))
    rates = (out == 1).double().mean(1)  # (N,) per-row ones-rate
    half_width = 3.29 * rates.std() / math.sqrt(N)
    assert abs(rates.mean() - 0.1) < half_width, (rates.mean(), half_width)


def test_sample_script_on_a_diffusion_checkpoint_refuses_the_sigma_flags(tmp_path, capsys):
    """The σ-GPT strategy flags would change nothing: one line naming them; the defaults and --steps sample."""
    from helpers import sample_script

    train(diffusion_cfg(tmp_path, max_iters=1, num_eval_samples=0))
    ckpt = ["--checkpoint", str(tmp_path / "ckpt.pt")]
    for flags, named in [(["--strategy", "autoregressive"], "--strategy"), (["--order", "left-to-right"], "--order"),
                         (["--acceptance", "paper", "--num-orders", "3"], "--acceptance, --num-orders"),
                         (["--live"], "--live")]:
        assert sample_script().main(ckpt + flags) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {named}") and err.count("\n") == 1, err
    assert sample_script().main(ckpt + ["--steps", "3", "--strategy", "burst"]) == 0
    assert "forward calls: 3" in capsys.readouterr().out
