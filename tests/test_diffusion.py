"""The discrete-diffusion baseline: noise laws, losses and the sampler (the trainer: test_diffusion_training.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import sigmafast
from sigmafast import SigmaGPTConfig, diffusion
from sigmafast.diffusion import DiffusionConfig, DiffusionGPT
from sigmafast.diffusion.noise import (
    NOISES, T_MIN, DiffusionBatch, corrupt, diffusion_loss, marginal, noisy_batch, uniform_posterior, uniform_tokens,
)
from helpers import P_FAIL as P_MIN, chi2_pvalue, tiny_model  # P_MIN: a correct law's p-values exceed it


def tiny_diffusion(noise: str, vocab_size: int = 5, block_size: int = 8, seed: int = 0,
                   pos_encoding: str = "sinusoidal") -> DiffusionGPT:
    """A random 2-layer DiffusionGPT whose weights are scaled up, so its x0 laws are far from uniform."""
    torch.manual_seed(seed)
    config = SigmaGPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32,
                            pos_encoding=pos_encoding)
    model = DiffusionGPT(config, DiffusionConfig(noise=noise))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.double().eval()


class ProductOracle(DiffusionGPT):
    """The exact p(x_0 | x_t) of iid Bernoulli(p_one) tokens over {0, 1} (MASK / BOS = 2)."""

    def __init__(self, noise: str, seq_len: int, p_one: float) -> None:
        config = SigmaGPTConfig(vocab_size=3, block_size=seq_len, n_layer=1, n_head=1, n_embd=2)
        super().__init__(config, DiffusionConfig(noise=noise))
        self.prior = torch.tensor([1 - p_one, p_one, 0.0], dtype=torch.float64)

    def forward(self, x_t, t):
        at_x_t = torch.nn.functional.one_hot(x_t, 3).double()  # (B, T, V)
        if self.noise == "absorbing":
            masked = (x_t == self.mask_id)[..., None]
            probs = torch.where(masked, self.prior, at_x_t)
        else:  # Bayes: p(x_0 = v | x_t) ∝ p(v) q(x_t | x_0 = v)
            a = (1 - t.double())[:, None, None]
            probs = self.prior * (a * at_x_t + (1 - a) / 2)
        return probs.log()


def binomial_pmf(n: int, p: float) -> torch.Tensor:
    """(n + 1,) float64 Binomial(n, p) probabilities."""
    k = torch.arange(n + 1, dtype=torch.float64)
    return torch.exp(torch.lgamma(torch.tensor(n + 1.0)) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
                     + k * math.log(p) + (n - k) * math.log(1 - p))


# --- forward process ------------------------------------------------------------------------------


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("mask_id", [4, 1])
def test_forward_marginals_match_closed_form(noise, mask_id):
    """Empirical q(x_t | x_0) over 4000 draws per (t, x_0) against the closed form (chi-square)."""
    V, N = 5, 4000
    data = [v for v in range(V) if v != mask_id]
    x0 = torch.tensor(data).repeat(N, 1)  # (N, 4): every data id, N times
    g = torch.Generator().manual_seed(1)
    for t_value in (0.05, 0.5, 0.9, 1.0):
        t = torch.full((N,), t_value)
        u_keep, u_token = torch.rand(N, len(data), generator=g), torch.rand(N, len(data), generator=g)
        x_t = corrupt(x0, t, noise, V, mask_id, u_keep, u_token)
        law = marginal(x0[:1], t[:1], noise, V, mask_id)[0]  # (4, V)
        assert torch.allclose(law.sum(-1), torch.ones(len(data), dtype=law.dtype))
        for i in range(len(data)):
            counts = torch.bincount(x_t[:, i], minlength=V)
            if (law[i] > 0).sum() == 1:  # a point mass (absorbing at t = 1): every draw on it
                assert counts[law[i] == 0].sum() == 0, (noise, t_value, data[i], counts)
            else:
                assert chi2_pvalue(counts, law[i]) > P_MIN, (noise, t_value, data[i], counts, law[i])
            if t_value <= 0.5:  # power: the law of another time is rejected
                wrong = marginal(x0[:1], t[:1] + 0.2, noise, V, mask_id)[0, i]
                assert chi2_pvalue(counts, wrong) < 1e-6


@pytest.mark.parametrize("noise", NOISES)
def test_noisy_batch_times_are_stratified(noise):
    x0 = torch.zeros(64, 10, dtype=torch.long)
    batch = noisy_batch(x0, noise, 3, 2, torch.Generator().manual_seed(0))
    assert batch.t.min() >= T_MIN and batch.t.max() <= 1.0
    strata = ((batch.t - T_MIN) / (1 - T_MIN) * 64).floor().long()
    assert sorted(strata.tolist()) == list(range(64)), "one time per 1/B stratum"


def test_uniform_posterior_matches_bayes():
    """p(x_s | x_t) = Σ_{x_0} q(x_s | x_t, x_0) p0(x_0), by explicit transition matrices."""
    V, mask_id, K = 6, 2, 5
    g = torch.Generator().manual_seed(0)
    data = torch.ones(V, dtype=torch.bool)
    data[mask_id] = False
    p0 = torch.rand(3, 4, V, generator=g, dtype=torch.float64) * data
    p0 /= p0.sum(-1, keepdim=True)
    x_t = torch.tensor([[0, 1, 3, 5], [4, 4, 0, 1], [5, 3, 1, 0]])
    alpha_t = torch.tensor([0.0, 0.3, 0.7], dtype=torch.float64)
    alpha_s = torch.tensor([0.25, 0.5, 0.95], dtype=torch.float64)
    got = uniform_posterior(p0, x_t, alpha_t, alpha_s, mask_id)

    def transition(a):  # (V, V) rows x_from -> x_to, uniform over the data ids
        return (a * torch.eye(V, dtype=torch.float64) + (1 - a) / K * data.double()) * data.double()[:, None]

    for b in range(3):
        q_s0, q_ts = transition(alpha_s[b]), transition(alpha_t[b] / alpha_s[b])  # q(x_s|x_0), q(x_t|x_s)
        for i in range(4):
            joint = q_s0 * q_ts[:, x_t[b, i]][None, :]  # (x_0, x_s): q(x_s | x_0) q(x_t | x_s)
            post = joint / joint.sum(1, keepdim=True).clamp_min(1e-300)  # q(x_s | x_t, x_0)
            want = (p0[b, i][:, None] * post).sum(0)
            assert torch.allclose(got[b, i], want, atol=1e-12), (b, i)


def test_absorbing_loss_of_the_true_law_is_its_entropy():
    """MDLM's NELBO per token is exact (= the entropy) for iid data and the true conditionals."""
    p_one, T, B = 0.1, 20, 4096
    oracle = ProductOracle("absorbing", T, p_one)
    g = torch.Generator().manual_seed(0)
    x0 = (torch.rand(B, T, generator=g) < p_one).long()
    losses = []
    for i in range(B // 256):  # per-batch losses: independent, each stratified over t
        batch = noisy_batch(x0[256 * i: 256 * (i + 1)], "absorbing", 3, 2, g)
        losses.append(diffusion_loss(oracle(batch.x_t, batch.t), batch, "absorbing", 2))
    losses = torch.stack(losses).double()
    entropy = -(p_one * math.log(p_one) + (1 - p_one) * math.log(1 - p_one))
    se = losses.std() / math.sqrt(len(losses))
    assert abs(losses.mean() - entropy) < 4 * se, (losses.mean(), entropy, se)
    clean = DiffusionBatch(x0[:4], x0[:4], torch.ones(4))
    assert diffusion_loss(torch.zeros(4, T, 3), clean, "absorbing", 2) == 0, "unmasked tokens cost nothing"


def test_factored_uniform_model_adds_the_token_likelihood():
    """Factored = plain logits + log q(x_t^i | x_0^i = v), with the same weights; absorbing is unaffected."""
    plain = tiny_diffusion("uniform")
    factored = DiffusionGPT(plain.config, DiffusionConfig("uniform", "factored")).double().eval()
    factored.load_state_dict(plain.state_dict())
    plain.diffusion_config = DiffusionConfig("uniform", "plain")
    g = torch.Generator().manual_seed(0)
    x_t = torch.randint(0, 4, (3, 8), generator=g)
    t = torch.tensor([0.05, 0.5, 1.0], dtype=torch.float64)
    alpha = (1 - t)[:, None, None]
    likelihood = alpha * torch.nn.functional.one_hot(x_t, 5) + (1 - alpha) / 4  # q(x_t^i | x_0^i = v), K = 4
    with torch.no_grad():
        diff = factored(x_t, t)[..., :4] - plain(x_t, t)[..., :4]
    assert torch.allclose(diff, likelihood[..., :4].log(), atol=1e-12)
    absorbing = tiny_diffusion("absorbing")
    with torch.no_grad():
        before = absorbing(x_t, t)
        absorbing.diffusion_config = DiffusionConfig("absorbing", "plain")
        assert torch.equal(before, absorbing(x_t, t))


@pytest.mark.parametrize("noise,parameterization", [("uniform", "factored"), ("uniform", "plain"),
                                                     ("absorbing", "factored")])
@pytest.mark.parametrize("chunk_elements", [2**25, 7 * 5], ids=["one-chunk", "chunks-of-7-rows"])
def test_chunked_loss_matches_the_loss_of_the_logits(monkeypatch, noise, parameterization, chunk_elements):
    """``model.loss`` (no (B, T, V) logits) equals ``diffusion_loss`` of the forward's logits, with gradients."""
    monkeypatch.setattr(sigmafast.loss, "LOSS_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(sigmafast.kernels.row_blocks, "CPU_BLOCK_ELEMENTS", chunk_elements)  # the CPU's default
    chunks = []
    chunk_loss = sigmafast.loss._chunk_loss
    monkeypatch.setattr(sigmafast.loss, "_chunk_loss", lambda h, *a: chunks.append(len(h)) or chunk_loss(h, *a))
    model = tiny_diffusion(noise).train()
    model.diffusion_config = DiffusionConfig(noise, parameterization)
    g = torch.Generator().manual_seed(1)
    batch = noisy_batch(torch.randint(0, 4, (3, 7), generator=g), noise, 5, model.mask_id, g)
    batch = DiffusionBatch(batch.x0, batch.x_t, batch.t.double())

    def grads(loss_fn):
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, g_full = grads(lambda: diffusion_loss(model(batch.x_t, batch.t).double(), batch, noise, model.mask_id))
    chunked, g_chunked = grads(lambda: model.loss(*batch))
    assert chunks == ([21] if chunk_elements == 2**25 else [7, 7, 7]), chunks  # the chunking really happens
    assert full > 0
    torch.testing.assert_close(chunked.double(), full, rtol=1e-10, atol=1e-12)
    assert g_full.keys() == g_chunked.keys()
    for name in g_full:
        torch.testing.assert_close(g_chunked[name], g_full[name], rtol=1e-8, atol=1e-12)


def test_chunked_loss_rejects_bad_targets():
    model = tiny_diffusion("absorbing")
    x_t, t = torch.zeros(2, 4, dtype=torch.long), torch.full((2,), 0.5, dtype=torch.float64)
    with pytest.raises(TypeError, match="x0 must be an int64"):
        model.loss(x_t.double(), x_t, t)
    with pytest.raises(ValueError, match="x0 must have the shape of x_t"):
        model.loss(torch.zeros(2, 3, dtype=torch.long), x_t, t)
    with pytest.raises(TypeError, match="x_t must be a .B, T. integer tensor, got torch.float64"):
        model(x_t.double(), t)
    with pytest.raises(ValueError, match=r"x_t must have shape \(B, T\), got \(8,\)"):
        model(x_t.view(-1), t)
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"^x_t must be in \[0, {V}\), got {V}$"):
        model.loss(x_t, x_t + V, t)
    with pytest.raises(ValueError, match=rf"^x0 must be in \[-1, {V}\) \(-1 ignored\), got -3$"):
        model.loss(x_t - 3, x_t, t)


def test_diffusion_config_parameterization():
    assert DiffusionConfig().parameterization == "factored"
    assert DiffusionConfig.from_dict({"noise": "uniform"}).parameterization == "plain", "older checkpoints"
    with pytest.raises(ValueError, match="parameterization"):
        DiffusionConfig(parameterization="x0")


# --- sampler ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos_encoding", ["sinusoidal", "rope", "rope-v"])
def test_the_backbone_sees_positions(pos_encoding):
    """Swapping two tokens changes the x0 law at a third position: attention without any position
    information would be a set function there (the rotary encoding must reach the backbone)."""
    model = tiny_diffusion("absorbing", pos_encoding=pos_encoding)
    x = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    swapped = x.clone()
    swapped[0, [0, 5]] = x[0, [5, 0]]
    t = torch.full((1,), 0.5, dtype=torch.float64)
    with torch.no_grad():
        a, b = model(x, t)[0, 2], model(swapped, t)[0, 2]
    assert not torch.allclose(a, b)


def test_sampler_rejects_bad_arguments():
    model = tiny_diffusion("absorbing")
    idx = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="DiffusionGPT"):
        diffusion.generate(tiny_model(), idx, 4)
    with pytest.raises(TypeError, match="sigmafast.diffusion.generate"):
        sigmafast.generate(model, idx, 4)
    with pytest.raises(ValueError, match="max_new_tokens is required"):
        diffusion.generate(model, idx)
    for steps in (0, -3):
        with pytest.raises(ValueError, match="steps must be >= 1"):
            diffusion.generate(model, idx, 4, steps=steps)
    for steps in (2.0, True):
        with pytest.raises(TypeError, match="steps must be an int"):
            diffusion.generate(model, idx, 4, steps=steps)
    out, stats = diffusion.generate(model, idx, 4, steps=np.int64(3), return_stats=True)  # as max_new_tokens
    assert stats.forward_calls == 3 and type(stats.forward_calls) is int
    with pytest.raises(ValueError, match="MASK / BOS id 4"):
        diffusion.generate(model, torch.full((2, 3), 4), 4)
    with pytest.raises(ValueError, match="temperature"):
        diffusion.generate(model, idx, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        diffusion.generate(model, idx, 6)
    with pytest.raises(TypeError, match="generator"):
        diffusion.generate(model, idx, 4, generator=0)


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("steps", [1, 3, 8])
def test_infilling_keeps_known_tokens_and_counts_steps(noise, steps):
    model = tiny_diffusion(noise)
    g = torch.Generator().manual_seed(steps)
    canvas = torch.randint(0, 4, (6, 8), generator=g)
    known = torch.rand(6, 8, generator=g) < 0.4
    known[0] = False
    out, stats = diffusion.generate(model, canvas, known=known, steps=steps, generator=g, return_stats=True)
    assert out.shape == (6, 8) and torch.equal(out[known], canvas[known])
    assert ((out >= 0) & (out < 4)).all(), "never the MASK id"
    assert stats.forward_calls == steps and stats.iterations.tolist() == [steps] * 6
    assert stats.accepted.shape == (6, steps) and stats.burst_lengths is None
    if noise == "absorbing":  # every unknown position is unmasked exactly once
        assert stats.accepted.sum(1).tolist() == (~known).sum(1).tolist()


@pytest.mark.parametrize("noise", NOISES)
def test_prompt_mode_reproducibility_and_greedy(noise):
    model = tiny_diffusion(noise)
    prompt = torch.tensor([[0, 1], [3, 3]])
    outs = [diffusion.generate(model, prompt, 5, steps=4, generator=torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert outs[0].shape == (2, 7) and torch.equal(outs[0][:, :2], prompt)
    assert torch.equal(outs[0], outs[1])
    other = diffusion.generate(model, prompt, 5, steps=4, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(outs[0], other)
    positional = diffusion.generate(model, prompt, 5, 0.7, 2, steps=4, generator=torch.Generator().manual_seed(7))
    keyword = diffusion.generate(model, prompt, 5, steps=4, generator=torch.Generator().manual_seed(7),
                                 temperature=0.7, top_k=2)  # sigmafast.generate's positional order
    assert torch.equal(positional, keyword)


@pytest.mark.parametrize("noise", NOISES)
def test_greedy_single_step_returns_the_x0_argmax(noise):
    """With S = 1 the step goes from t = 1 to 0: x_0 is the argmax of p(x_0 | x_1) at temperature 0."""
    model = tiny_diffusion(noise)
    prompt = torch.tensor([[0, 1], [3, 3]])
    out = diffusion.generate(model, prompt, 5, steps=1, temperature=0.0, generator=torch.Generator().manual_seed(3))
    x1 = torch.cat([prompt, torch.full((2, 5), 4)], 1)  # absorbing: all masked
    if noise == "uniform":  # x_1 is drawn first, from u_init (float64, over all positions)
        u_init = torch.rand(2, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        x1[:, 2:] = uniform_tokens(u_init, 5, 4)[:, 2:]
    with torch.no_grad():
        logits = model(x1, torch.ones(2, dtype=torch.float64))
    assert torch.equal(out[:, 2:], logits.argmax(-1)[:, 2:])


@pytest.mark.parametrize("noise", NOISES)
def test_non_finite_logits_raise_like_sigmafast_generate(noise):
    """A model whose x0 logits are NaN (diverged weights) is an error, as in ``sigmafast.generate``, not a
    canvas of arbitrary tokens; NaN logits at known positions only are never read and pass."""
    model = tiny_diffusion(noise)
    prompt = torch.tensor([[0, 1], [3, 3]])
    forward = model.forward

    def broken(x_t, t, only_known=False):
        logits = forward(x_t, t).clone()
        logits[1, 0 if only_known else 4] = float("nan")  # row 1: position 0 is known, position 4 is not
        return logits

    model.forward = broken
    with pytest.raises(ValueError, match="non-finite logits"):
        diffusion.generate(model, prompt, 5, steps=3, generator=torch.Generator().manual_seed(0))
    model.forward = lambda x_t, t: broken(x_t, t, only_known=True)
    out = diffusion.generate(model, prompt, 5, steps=3, generator=torch.Generator().manual_seed(0))
    assert ((out >= 0) & (out < 4)).all()


def test_nothing_to_sample_makes_no_model_call():
    model = tiny_diffusion("uniform")
    canvas = torch.randint(0, 4, (2, 5))
    out, stats = diffusion.generate(model, canvas, known=torch.ones(2, 5, dtype=torch.bool), return_stats=True)
    assert torch.equal(out, canvas) and stats.forward_calls == 0 and stats.accepted.shape == (2, 0)


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("steps", [1, 3, 12])
def test_sampler_with_the_exact_x0_law_samples_the_product_law(noise, steps):
    """With the true p(x_0 | x_t) the reverse process is exact: the number of ones per row of 4000
    rows follows Binomial(T, p) (chi-square), whatever the number of steps."""
    p_one, T, N = 0.3, 12, 4000
    oracle = ProductOracle(noise, T, p_one)
    out = diffusion.generate(oracle, torch.zeros(N, 0, dtype=torch.long), T, steps=steps,
                             generator=torch.Generator().manual_seed(steps))
    assert ((out == 0) | (out == 1)).all()
    ones = (out == 1).sum(1)
    assert chi2_pvalue(torch.bincount(ones, minlength=T + 1), binomial_pmf(T, p_one)) > P_MIN
    position_rate = (out == 1).double().mean(0)  # every position is Bernoulli(p)
    # 5 sigma: a correct sampler's 12 positions in 6 tests stray past it with probability 4e-5 (4 sigma: 5e-3)
    assert ((position_rate - p_one).abs() < 5 * math.sqrt(p_one * (1 - p_one) / N)).all()


def test_absorbing_sampler_unmasks_each_position_at_a_uniform_step():
    """Unmasking a masked position with probability 1/k at step k (k = S .. 1) spreads its unmasking
    uniformly over the S steps: the (step) counts of 4000 rows x 12 positions against 1/S each."""
    T, N, S = 12, 4000, 4
    oracle = ProductOracle("absorbing", T, 0.3)
    _, stats = diffusion.generate(oracle, torch.zeros(N, 0, dtype=torch.long), T, steps=S, return_stats=True,
                                  generator=torch.Generator().manual_seed(11))
    per_step = stats.accepted.sum(0)  # (S,)
    assert int(per_step.sum()) == N * T
    assert chi2_pvalue(per_step, torch.full((S,), 1.0 / S, dtype=torch.float64)) > P_MIN


@pytest.mark.parametrize("noise,steps", [("absorbing", 4), ("uniform", 1)])
def test_sampler_tempers_and_truncates_the_x0_law(noise, steps):
    """With the true p(x_0 | x_t), each token is drawn once from the tempered x_0 law (absorbing: when its
    position unmasks; uniform: in one step from pure noise): at temperature 1/2 the ones per row follow
    Binomial(T, p^2 / (p^2 + (1 - p)^2)); top-1 keeps the likelier token, 0, everywhere."""
    p_one, T, N = 0.3, 12, 4000
    oracle = ProductOracle(noise, T, p_one)
    out = diffusion.generate(oracle, torch.zeros(N, 0, dtype=torch.long), T, steps=steps, temperature=0.5,
                             generator=torch.Generator().manual_seed(12))
    tempered = p_one**2 / (p_one**2 + (1 - p_one) ** 2)
    assert chi2_pvalue(torch.bincount((out == 1).sum(1), minlength=T + 1), binomial_pmf(T, tempered)) > P_MIN
    top1 = diffusion.generate(oracle, torch.zeros(64, 0, dtype=torch.long), T, steps=steps, top_k=1,
                              generator=torch.Generator().manual_seed(13))
    assert (top1 == 0).all()
