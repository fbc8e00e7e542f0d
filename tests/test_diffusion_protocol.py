"""The diffusion baseline's network and sampler against their documented definitions, step by step: what the
backbone sees, what each model call of ``diffusion.generate`` is given, the draws it consumes, and the
validation loss."""

from __future__ import annotations

import pytest
import torch

from sigmafast import SigmaGPTConfig, diffusion
from sigmafast.diffusion import DiffusionConfig, DiffusionGPT
from sigmafast.diffusion.noise import NOISES, T_MIN, noisy_batch, uniform_posterior, uniform_tokens
from sigmafast.diffusion.training import estimate_val_loss, make_batch
from sigmafast.kernels.reference import inverse_cdf, sample
from test_diffusion import tiny_diffusion


def test_every_position_sees_the_whole_canvas_and_the_time():
    """Attention is bidirectional: the x0 law at position 0 depends on the last token (a causal mask hides
    it). Absorbing noise adds no likelihood term to the logits, so their dependence on t comes from the
    time embedding alone."""
    model = tiny_diffusion("absorbing")
    x = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    later = x.clone()
    later[0, -1] = 0
    t = torch.full((1,), 0.5, dtype=torch.float64)
    with torch.no_grad():
        assert not torch.allclose(model(x, t)[0, 0], model(later, t)[0, 0])
        assert not torch.allclose(model(x, t), model(x, torch.full((1,), 0.25, dtype=torch.float64)))


class Recorder:
    """Wraps a model's forward, recording each call's (x_t, t)."""

    def __init__(self, model) -> None:
        self.calls, self.forward = [], model.forward
        model.forward = self

    def __call__(self, x_t, t):
        self.calls.append((x_t.clone(), t.clone()))
        return self.forward(x_t, t)


@pytest.mark.parametrize("S", [3, 19], ids=["fewer-steps-than-tokens", "more-steps-than-tokens"])
@pytest.mark.parametrize("noise", NOISES)
def test_sampler_follows_its_documented_protocol(noise, S):
    """``generate`` replayed from the module docstring of ``sigmafast.diffusion.sampler``: step k = S..1 calls
    the model once on (x_{t_k}, t_k = k/S), the known tokens given as is and (absorbing) every other
    position still masked given as MASK; then the draws, float64 (B, T) from the generator in their order
    (absorbing: u_unmask, u_token; uniform: u_init once, then u_token), and the documented reverse step."""
    model = tiny_diffusion(noise)
    recorder = Recorder(model)
    B, T, M, temperature, top_k = 3, 8, model.mask_id, 0.8, 3
    g = torch.Generator().manual_seed(5)
    canvas = torch.randint(0, 4, (B, T), generator=g)
    known = torch.rand(B, T, generator=g) < 0.4
    out, stats = diffusion.generate(model, canvas, known=known, steps=S, temperature=temperature, top_k=top_k,
                                    generator=torch.Generator().manual_seed(9), return_stats=True)
    g = torch.Generator().manual_seed(9)

    def u():
        return torch.rand(B, T, generator=g, dtype=torch.float64)

    masked, counts = ~known, []
    x = torch.where(known, canvas, uniform_tokens(u(), 5, M) if noise == "uniform" else torch.full_like(canvas, M))
    assert len(recorder.calls) == S
    for (x_seen, t_seen), k in zip(recorder.calls, range(S, 0, -1)):
        assert torch.equal(x_seen, x) and torch.equal(t_seen, torch.full((B,), k / S)), k
        with torch.no_grad():
            logits = recorder.forward(x, t_seen)
        if noise == "absorbing":
            u_unmask, u_token = u(), u()
            tokens = sample(logits.reshape(B * T, -1), u_token.reshape(B * T), temperature, top_k)[0].view(B, T)
            unmask = masked & (u_unmask < 1 / k)
            x, masked = torch.where(unmask, tokens, x), masked & ~unmask
            counts.append(unmask.sum(1))  # positions unmasked
        else:
            logits = logits.float() / temperature
            logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[..., -1:], float("-inf"))
            post = uniform_posterior(logits.softmax(-1), x, 1 - t_seen, torch.full((B,), 1 - (k - 1) / S), M)
            new = torch.where(known, x, inverse_cdf(post.reshape(B * T, -1), u().reshape(B * T)).view(B, T))
            counts.append((new != x).sum(1))  # positions changed
            x = new
    assert torch.equal(out, x) and not (out == M).any()
    assert torch.equal(stats.accepted, torch.stack(counts, 1))


def test_steps_default_to_the_canvas_length():
    model = tiny_diffusion("absorbing")
    known = torch.zeros(2, 7, dtype=torch.bool)
    known[:, :2] = True
    for kwargs in (dict(idx=torch.zeros(2, 2, dtype=torch.long), max_new_tokens=5),
                   dict(idx=torch.zeros(2, 7, dtype=torch.long), known=known)):
        _, stats = diffusion.generate(model, **kwargs, return_stats=True)
        assert stats.forward_calls == 7 and stats.iterations.tolist() == [7, 7]


def test_fresh_model_is_the_backbone_and_evaluates_deterministically():
    """The time embedding's output layer starts at zero: a fresh model's logits do not depend on t. Dropout
    acts in training mode only."""
    config = SigmaGPTConfig(vocab_size=5, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.5)
    torch.manual_seed(0)
    model = DiffusionGPT(config, DiffusionConfig("absorbing")).double().eval()
    x = torch.tensor([[0, 1, 4, 3, 0, 4, 2, 3]])
    with torch.no_grad():
        logits = model(x, torch.full((1,), 0.9, dtype=torch.float64))
        assert torch.equal(logits, model(x, torch.full((1,), 0.1, dtype=torch.float64)))
        assert not torch.equal(model.train()(x, torch.full((1,), 0.1, dtype=torch.float64)), logits)


def test_training_times_follow_the_documented_low_discrepancy_map():
    """t_i = T_MIN + (1 - T_MIN) ((u + i/B) mod 1), one uniform u per batch drawn first from the generator."""
    B = 64
    batch = noisy_batch(torch.zeros(B, 3, dtype=torch.long), "absorbing", 3, 2, torch.Generator().manual_seed(4))
    u = torch.rand((), generator=torch.Generator().manual_seed(4))
    want = T_MIN + (1 - T_MIN) * ((u + torch.arange(B) / B) % 1.0)
    assert torch.equal(batch.t, want) and batch.t.max() <= 1


@pytest.mark.parametrize("noise", NOISES)
def test_validation_loss_is_the_mean_loss_of_the_noised_batches(noise):
    """``estimate_val_loss`` is the plain mean of ``model.loss`` over the batches, each noised in turn from
    the generator."""
    model = tiny_diffusion(noise)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 4, (4, 8), generator=g) for _ in range(3)]
    got = estimate_val_loss(model, xs, torch.Generator().manual_seed(1), torch.autocast("cpu", enabled=False), "cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        losses = [model.loss(*make_batch(model, x, g)) for x in xs]
    assert got == pytest.approx(float(sum(losses) / 3), rel=1e-6)
    assert len({float(v) for v in losses}) == 3
