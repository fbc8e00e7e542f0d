"""What a training step trains on: its micro-batches, the learning-rate schedule, the optimizer's groups,
gradient clipping, the loss weights and the chunked loss's logits."""

import pytest
import torch

from sigmafast.batches import get_batch
from sigmafast.kernels import row_blocks
from sigmafast.loss import step_weights
from sigmafast.model import SigmaGPT
from sigmafast.tasks import get_task
from sigmafast.train import TrainConfig, build_model_config, configure_optimizer, learning_rate, train
from sigmafast.train_config import resolve
from helpers import small_cfg

pytestmark = pytest.mark.usefixtures("one_thread")

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
