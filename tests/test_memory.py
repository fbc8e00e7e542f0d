"""Peak-memory estimates (sigmafast/memory.py): their terms against what PyTorch really holds."""

from __future__ import annotations

import pytest
import torch

from sigmafast.memory import (
    GIB, LOSS_CHUNK_ELEMENTS, available_bytes, check_training_memory, loss_chunk_rows, model_state_elements,
    training_peak_bytes,
)
from sigmafast.model import SigmaGPT, SigmaGPTConfig

CONFIGS = [
    pytest.param(dict(n_layer=2, n_head=2, n_embd=64, vocab_size=100), 8, 64, id="tiny"),
    pytest.param(dict(n_layer=4, n_head=4, n_embd=128, vocab_size=50, pos_encoding="learned"), 4, 128, id="small"),
    pytest.param(dict(n_layer=3, n_head=2, n_embd=32, vocab_size=7, bias=False), 2, 16, id="no-bias"),
    pytest.param(dict(n_layer=2, n_head=2, n_embd=64, vocab_size=101, mlp_ratio=0), 4, 100, id="attention-only"),
    pytest.param(dict(n_layer=2, n_head=2, n_embd=32, vocab_size=9, mlp_ratio=0, bias=False), 3, 20,
                 id="attention-only-no-bias"),
    pytest.param(dict(n_layer=1, n_head=2, n_embd=64, vocab_size=101, mlp_ratio=0, bias=False, final_norm="scalar",
                      pos_encoding="rope"), 4, 100, id="permutation-recipe"),
    pytest.param(dict(n_layer=1, n_head=4, n_embd=64, vocab_size=30, mlp_ratio=1), 2, 32, id="mlp-ratio-1"),
    pytest.param(dict(n_layer=2, n_head=4, n_embd=64, vocab_size=30, pos_encoding="rope-v+learned"), 2, 24,
                 id="rope-v-learned"),
    pytest.param(dict(n_layer=1, n_head=8, n_embd=64, vocab_size=30, pos_encoding="rope+sinusoidal"), 2, 24,
                 id="rope-sinusoidal"),
]


def _config(arch: dict, seq_len: int) -> SigmaGPTConfig:
    return SigmaGPTConfig(block_size=seq_len, **arch)


@pytest.mark.parametrize("arch,batch,seq_len", CONFIGS)
def test_model_state_is_counted_without_building_the_model(arch, batch, seq_len):
    cfg = _config(arch, seq_len)
    model = SigmaGPT(cfg)
    assert model_state_elements(cfg) == sum(t.numel() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("arch,batch,seq_len", CONFIGS)
def test_activation_term_matches_the_bytes_autograd_saves(arch, batch, seq_len, autocast):
    """The activation term, 4 B T C ((8 + 2 r) L + 2) in fp32 (16 L + 2 at ``mlp_ratio`` r = 4, 6 L + 2 at
    r = 0), against the storages saved for the backward of a real forward (up to the final LayerNorm; the
    loss is its own term); under bf16 autocast the LayerNorms' inputs stay float32. The estimate omits small
    tensors (LayerNorm statistics, attention log-sum-exp), so it may differ by a few percent, never by 10%."""
    cfg = _config(arch, seq_len)
    torch.manual_seed(0)
    model = SigmaGPT(cfg)
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size - 1, (batch, seq_len))
    pos = torch.arange(seq_len).expand(batch, seq_len)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        x = model.embed(tokens, pos, pos)
        for block in model.h:
            x = block(x)
        model.ln_f(x)
    states = 16 * model_state_elements(cfg)
    C, V = cfg.n_embd, cfg.vocab_size
    loss = 4 * (3 * min(batch * seq_len, loss_chunk_rows(V)) * V + batch * seq_len * C + 2 * V * C)
    head_cast = 2 * V * C if autocast else 0  # the LM head's bf16 weight, cast in the loss (not run here)
    estimate = training_peak_bytes(cfg, batch, seq_len, activation_bytes=2 if autocast else 4) - states - loss
    estimate -= head_cast
    per_layer = 8 + 2 * cfg.mlp_ratio if cfg.mlp_ratio else 6
    if not autocast:
        assert estimate == 4 * batch * seq_len * C * (per_layer * cfg.n_layer + 2)
    assert abs(sum(saved.values()) / estimate - 1) < 0.1, (sum(saved.values()), estimate)


def test_loss_term_is_capped_by_the_chunk():
    assert loss_chunk_rows(50257) == LOSS_CHUNK_ELEMENTS // 50257 == 667
    assert loss_chunk_rows(2**26) == 1
    cfg = SigmaGPTConfig(vocab_size=50257, block_size=1024, n_layer=2, n_head=2, n_embd=64)
    small, big = training_peak_bytes(cfg, 32, 1024), training_peak_bytes(cfg, 64, 1024)
    activations, grad_hidden = 4 * 32 * 1024 * 64 * (16 * 2 + 2), 4 * 32 * 1024 * 64
    assert big - small == activations + grad_hidden  # the logits' term no longer grows with B T
    halved = 2 * 32 * 1024 * 64 * (14 * 2)  # all but the LayerNorms' inputs and the final norm's output
    casts = 2 * (12 * 64 * 64 * 2 + 50257 * 64)  # autocast's bf16 copies of the matmuls' weights
    assert training_peak_bytes(cfg, 32, 1024, activation_bytes=2) == small - halved + casts


def test_cuda_memory_the_caching_allocator_holds_unused_counts_as_available(monkeypatch):
    """On CUDA ``mem_get_info`` counts the blocks PyTorch's caching allocator keeps after their tensors are freed
    (a training step's activations, before an evaluation samples) as taken; this process can reuse them."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * gib)
    assert available_bytes(torch.device("cuda", 0)) == 7 * gib


def test_available_memory_and_the_training_check():
    have = available_bytes(torch.device("cpu"))
    assert have is None or have > 0
    cfg = SigmaGPTConfig(vocab_size=100, block_size=64, n_layer=2, n_head=2, n_embd=64)
    need = training_peak_bytes(cfg, 8, 64)
    assert check_training_memory(cfg, 8, 64, torch.device("cpu"), available=need) == need
    with pytest.raises(ValueError, match=r"needs about .* GiB .* reduce --batch-size .*--seq-len.*--n-layer"):
        check_training_memory(cfg, 8, 64, torch.device("cpu"), available=need - 1)
    assert need < GIB


def test_only_burst_sampling_checks_the_burst_memory(monkeypatch):
    """The burst estimate (whose error says "reduce num_orders") guards the burst samplers only: autoregressive
    sampling (checked for its KV cache instead), densities and the diffusion sampler run no burst iteration."""
    import sigmafast
    import sigmafast.request
    import sigmafast.naive
    from sigmafast import diffusion
    from sigmafast.density import conditional_density
    from sigmafast.diffusion import DiffusionConfig, DiffusionGPT

    def refuse(*args, **kwargs):
        raise ValueError("the burst memory check ran")

    monkeypatch.setattr(sigmafast.request, "check_sampling_memory", refuse)
    config = SigmaGPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=2, n_embd=16)
    model = SigmaGPT(config).eval()
    empty = torch.zeros(2, 0, dtype=torch.long)
    for generate in (sigmafast.generate, sigmafast.naive.generate):
        with pytest.raises(ValueError, match="the burst memory check ran"):
            generate(model, empty, 6)
        assert generate(model, empty, 6, strategy="autoregressive").shape == (2, 6)
    with pytest.raises(ValueError, match="the burst memory check ran"):
        sigmafast.warmup(model, 2, 6)
    known = torch.zeros(2, 6, dtype=torch.bool)
    assert conditional_density(model, torch.zeros(2, 6, dtype=torch.long), known).shape == (2, 6, 7)
    noised = DiffusionGPT(config, DiffusionConfig(noise="absorbing")).eval()
    assert diffusion.generate(noised, empty, 6).shape == (2, 6)


def test_the_burst_memory_check_counts_the_engine_s_batch_bucket(monkeypatch):
    """An engine with buckets allocates the next power of two of the batch: 9 rows are checked as 16."""
    import sigmafast
    import sigmafast.request

    checked = []

    def record(config, batch_size, *args, **kwargs):
        checked.append(batch_size)
        return 0

    monkeypatch.setattr(sigmafast.request, "check_sampling_memory", record)
    model = SigmaGPT(SigmaGPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=2, n_embd=16)).eval()
    empty = torch.zeros(9, 0, dtype=torch.long)
    sigmafast.generate(model, empty, 6)
    sigmafast.generate(sigmafast.Engine(model, buckets=True), empty, 6)
    sigmafast.warmup(sigmafast.Engine(model, buckets=True), 9, 6)
    assert checked == [9, 16, 16]


def test_autoregressive_sampling_checks_its_kv_cache(monkeypatch):
    """The decoding estimate counts the KV cache the engine allocates; both samplers refuse, naming the batch,
    a cache larger than the available memory (here made small), after the canvas (a few bytes) passed."""
    import sigmafast
    import sigmafast.memory
    import sigmafast.naive
    from sigmafast.cache import KVCache
    from sigmafast.memory import CANVAS_BYTES, check_decoding_memory, decoding_peak_bytes

    config = SigmaGPTConfig(vocab_size=7, block_size=6, n_layer=2, n_head=2, n_embd=16)
    cache = KVCache(config.n_layer, 3, config.n_head, 6, config.head_dim)
    rest = 6 * 4 * 3 * config.n_embd + 4 * 3 * config.vocab_size + CANVAS_BYTES * 3 * 6
    assert decoding_peak_bytes(config, 3, 6, 4) == cache.k.nbytes + cache.v.nbytes + rest
    need = decoding_peak_bytes(config, 3, 6, 4)
    assert check_decoding_memory(config, 3, 6, torch.device("cpu"), 4, available=need) == need
    with pytest.raises(ValueError, match="autoregressive sampling of 3 rows of 6 tokens .* reduce the batch$"):
        check_decoding_memory(config, 3, 6, torch.device("cpu"), 4, available=need - 1)

    model = SigmaGPT(config).eval()
    monkeypatch.setattr(sigmafast.memory, "SAMPLING_CHECK_FLOOR", 0)
    monkeypatch.setattr(sigmafast.memory, "available_bytes", lambda device: need - 1)
    empty = torch.zeros(3, 0, dtype=torch.long)
    for generate in (sigmafast.generate, sigmafast.naive.generate):
        with pytest.raises(ValueError, match="autoregressive sampling of 3 rows of 6 tokens"):
            generate(model, empty, 6, strategy="autoregressive")


def test_autoregressive_sampling_counts_its_prompt_s_prefill_on_the_reference_path(monkeypatch):
    """The reference attention of a prompt's prefill scores its M queries against every cache slot and the prompt:
    (B, 1, H, M, T + 1 + M) scores and their softmax, counted for the prompt's largest known count (the count
    ``generate`` reads anyway); refused, naming the batch, when they do not fit, and run when they do."""
    import sigmafast
    import sigmafast.memory
    import sigmafast.naive
    from sigmafast.memory import decoding_peak_bytes

    config = SigmaGPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=2, n_embd=16)
    need = decoding_peak_bytes(config, 3, 6, 4, prefill=4)
    assert need - decoding_peak_bytes(config, 3, 6, 4) == 2 * 4 * 3 * 2 * 4 * (6 + 1 + 4)
    model = SigmaGPT(config).eval()
    monkeypatch.setattr(sigmafast.memory, "SAMPLING_CHECK_FLOOR", 0)
    prompt = torch.zeros(3, 4, dtype=torch.long)
    prompt_known = torch.zeros(3, 6, dtype=torch.long), torch.arange(6).expand(3, 6) < torch.tensor([[1], [4], [2]])
    for generate in (sigmafast.generate, sigmafast.naive.generate):
        monkeypatch.setattr(sigmafast.memory, "available_bytes", lambda device: need - 1)
        with pytest.raises(ValueError, match="autoregressive sampling of 3 rows of 6 tokens"):
            generate(model, prompt, 2, strategy="autoregressive")
        with pytest.raises(ValueError, match="autoregressive sampling of 3 rows of 6 tokens"):
            generate(model, prompt_known[0], known=prompt_known[1], strategy="autoregressive")
        monkeypatch.setattr(sigmafast.memory, "available_bytes", lambda device: need)
        assert generate(model, prompt, 2, strategy="autoregressive").shape == (3, 6)


def test_a_canvas_larger_than_memory_is_refused_before_it_is_built():
    """An expanded idx of 10**12 rows costs nothing; its canvas would need terabytes: every sampler refuses it
    with one message naming the batch, for a prompt and for infilling alike."""
    import sigmafast
    import sigmafast.naive
    from sigmafast import diffusion
    from sigmafast.density import conditional_density
    from sigmafast.diffusion import DiffusionConfig, DiffusionGPT
    from sigmafast.memory import CANVAS_BYTES, check_canvas_memory

    assert check_canvas_memory(5, 7, torch.device("cpu"), available=CANVAS_BYTES * 35) == CANVAS_BYTES * 35
    with pytest.raises(ValueError, match=r"a canvas of 5 rows of 7 tokens .* reduce the batch \(the rows of idx\)"):
        check_canvas_memory(5, 7, torch.device("cpu"), available=CANVAS_BYTES * 35 - 1)
    config = SigmaGPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=2, n_embd=16)
    model = SigmaGPT(config).eval()
    rows = 10**12
    prompt = torch.zeros(1, 2, dtype=torch.long).expand(rows, 2)
    canvas, known = torch.zeros(1, 6, dtype=torch.long).expand(rows, 6), torch.zeros(1, 6, dtype=torch.bool)
    match = f"a canvas of {rows} rows of 6 tokens"
    for generate in (sigmafast.generate, sigmafast.naive.generate):
        for strategy in ("burst", "autoregressive"):
            with pytest.raises(ValueError, match=match):
                generate(model, prompt, 4, strategy=strategy)
            with pytest.raises(ValueError, match=match):
                generate(model, canvas, known=known.expand(rows, 6), strategy=strategy)
    with pytest.raises(ValueError, match=match):
        conditional_density(model, canvas, known.expand(rows, 6))
    noised = DiffusionGPT(config, DiffusionConfig(noise="absorbing")).eval()
    with pytest.raises(ValueError, match=match):
        diffusion.generate(noised, prompt, 4)


@pytest.mark.parametrize("reference", [True, False], ids=["reference", "triton"])
def test_densities_check_their_probabilities_memory(monkeypatch, reference):
    """``conditional_density`` and ``log_likelihood`` return or reduce (B, T, V) probabilities: the estimate counts
    them (the logits in the model's dtype and two float32 copies), and both refuse, naming the batch, a forward
    whose probabilities exceed the available memory (here made small) before running it."""
    import sigmafast.memory
    from sigmafast import kernels
    from sigmafast.density import conditional_density, log_likelihood
    from sigmafast.memory import check_density_memory, density_peak_bytes, sampling_peak_bytes

    config = SigmaGPTConfig(vocab_size=7, block_size=6, n_layer=1, n_head=2, n_embd=16)
    need = density_peak_bytes(config, 3, 6, 4, reference)
    base = sampling_peak_bytes(config, 3, 1, 6, 4, block_elements=0) if reference else \
        sampling_peak_bytes(config, 3, 1, 6, 4) - 4 * 3 * 6 * 7
    assert need == base + 12 * 3 * 6 * 7
    assert check_density_memory(config, 3, 6, torch.device("cpu"), 4, reference, available=need) == need
    message = r"probabilities of 3 rows of 6 tokens over 7 values .* reduce the batch \(the rows of idx\)$"
    with pytest.raises(ValueError, match=message):
        check_density_memory(config, 3, 6, torch.device("cpu"), 4, reference, available=need - 1)

    model = SigmaGPT(config).eval()
    monkeypatch.setattr(kernels, "backend_for", lambda t: "reference" if reference else "triton")
    monkeypatch.setattr(sigmafast.memory, "SAMPLING_CHECK_FLOOR", 0)
    monkeypatch.setattr(sigmafast.memory, "available_bytes", lambda device: need - 1)
    x = torch.zeros(3, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="probabilities of 3 rows of 6 tokens"):
        conditional_density(model, x, torch.zeros(3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="probabilities of 3 rows of 6 tokens"):
        log_likelihood(model, x, "left-to-right")
    monkeypatch.setattr(sigmafast.memory, "available_bytes", lambda device: need)
    assert log_likelihood(model, x, "left-to-right").shape == (3,)
