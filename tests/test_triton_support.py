"""The kernels' Triton floor (``kernels.support``): with a triton too old or missing, ``auto`` takes the
reference, an explicit ``triton`` backend and every launch raise ``TritonUnavailable``, and sampling still
works. An old triton is simulated by raising the floor, a missing one by hiding the module."""

import sys
from types import SimpleNamespace

import pytest
import torch

import sigmafast
from helpers import interpreter_numpy_problem, tiny_model, triton_device
from sigmafast import kernels
from sigmafast.kernels import reference as ref
from sigmafast.kernels import support


@pytest.fixture
def triton_too_old(monkeypatch):
    """This process's triton, below a floor raised past it."""
    monkeypatch.setattr(support, "MIN_TRITON", (99, 0))
    support.triton_problem.cache_clear()
    yield
    support.triton_problem.cache_clear()


@pytest.mark.parametrize("version, want", [("3.4.0", (3, 4)), ("3.0.0", (3, 0)), ("3.5.0+git1b0418a9", (3, 5)),
                                           ("10.12", (10, 12)), ("3", None), ("", None)],
                         ids=["release", "old", "local", "two-digit", "major-only", "empty"])
def test_version_tuple(version, want):
    assert support.version_tuple(version) == want


@pytest.mark.parametrize("triton_version, numpy_version, stops", [
    ("3.4.0", "2.4.0", True), ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
    ("3.9.0", "2.5.0", False), ("3.3.1", "2.4.6", False), ("", "2.4.6", False)],
    ids=["3.4-numpy2.4", "3.6-numpy2.4", "3.6-numpy2.3", "3.7-numpy2.4", "3.9-numpy2.5", "below-floor", "unread"])
def test_the_suite_stops_where_the_interpreter_refuses_this_numpy(triton_version, numpy_version, stops):
    """conftest stops the session at once (``pytest.UsageError``) for the interpreters of Triton 3.4 to 3.6 under
    NumPy 2.4, where nearly every kernel test would fail; they run with ``numpy<2.4``."""
    problem = interpreter_numpy_problem(triton_version, numpy_version)
    assert (problem is not None) == stops
    assert problem is None or f"triton {triton_version} cannot run the kernels with numpy {numpy_version}" in problem


def test_this_triton_runs_the_kernels_if_it_is_recent_enough():
    import triton

    recent = support.version_tuple(triton.__version__) >= kernels.MIN_TRITON
    assert (kernels.triton_problem() is None) == recent


def test_an_old_triton_is_named_in_the_problem(triton_too_old):
    import triton

    problem = kernels.triton_problem()
    assert problem is not None and f"found triton {triton.__version__}" in problem


def test_a_missing_triton_is_named_in_the_problem(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    support.triton_problem.cache_clear()
    try:
        problem = kernels.triton_problem()
    finally:
        support.triton_problem.cache_clear()
    assert problem is not None and problem.startswith("triton cannot be imported")


def test_auto_takes_the_reference_below_the_floor(triton_too_old):
    with kernels.use_backend("auto"):
        assert kernels.backend_for(torch.zeros(3)) == "reference"  # in the interpreter, "triton" above the floor
        cuda_like = SimpleNamespace(dtype=torch.float32, is_cuda=True)  # backend_for reads only these two
        with pytest.warns(RuntimeWarning, match=r"need triton >= 99\.0.*slower PyTorch reference"):
            assert kernels.backend_for(cuda_like) == "reference"


@pytest.mark.skipif(kernels.triton_problem() is not None, reason="this triton is below the floor")
def test_auto_takes_triton_above_the_floor():
    cuda_like = SimpleNamespace(dtype=torch.float32, is_cuda=True)
    with kernels.use_backend("auto"):
        assert kernels.backend_for(cuda_like) == "triton"


def test_an_explicit_triton_backend_raises_below_the_floor(triton_too_old):
    logits, u = torch.randn(4, 9), torch.rand(4)
    with pytest.raises(kernels.TritonUnavailable, match=r"backend='triton' needs triton >= 99\.0; found triton"):
        kernels.sample(logits, u, backend="triton")
    with kernels.use_backend("triton"), pytest.raises(kernels.TritonUnavailable, match="the triton backend needs"):
        kernels.sample(logits, u)
    tokens, _ = kernels.sample(logits, u, backend="reference")  # the reference is untouched
    assert torch.equal(tokens, ref.sample(logits, u)[0])


def test_a_direct_kernel_launch_raises_below_the_floor(triton_too_old):
    from sigmafast.kernels import sampling

    logits, u = torch.randn(4, 9, device=triton_device()), torch.rand(4, device=triton_device())
    with pytest.raises(kernels.TritonUnavailable, match="a sigmafast Triton kernel needs triton"):
        sampling.sample(logits, u)


def test_generate_samples_on_the_reference_below_the_floor(triton_too_old):
    model = tiny_model(vocab_size=7, dtype=torch.float32)
    prompt = torch.tensor([[1, 2], [3, 4]])
    with kernels.use_backend("auto"):
        got = sigmafast.generate(model, prompt, 6, generator=torch.Generator().manual_seed(0))
    with kernels.use_backend("reference"):
        want = sigmafast.generate(model, prompt, 6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, want)


def test_programmatic_dependent_launch_needs_a_newer_triton(monkeypatch):
    import triton

    recent = support.version_tuple(triton.__version__) >= support.PDL_TRITON
    assert support.triton_has_pdl() == (kernels.triton_problem() is None and recent)
    monkeypatch.setattr(support, "PDL_TRITON", (99, 0))
    support.triton_has_pdl.cache_clear()
    try:
        assert not support.triton_has_pdl()
    finally:
        support.triton_has_pdl.cache_clear()
