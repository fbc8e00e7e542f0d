"""Test-session setup.

Without a CUDA device, ``TRITON_INTERPRET=1`` is set (before triton is
imported) so that the Triton kernels run in the interpreter on CPU; with one,
the kernels compile for the GPU as in production. The default kernel backend
of the session stays the PyTorch reference; kernel tests call the Triton ops
directly or inside ``sigmafast.kernels.use_backend("triton")``.

The tests use tiny tensors, for which PyTorch's intra-op thread pool costs more
than it saves on a small shared CPU, so the session runs single-threaded, and
the suite runs in one process per core instead (pytest-xdist, in the ``test``
extra) unless the command line says otherwise (``-n 0``: one process).

With a triton older than the kernels need (``sigmafast.kernels.MIN_TRITON``), a
test that reaches a Triton kernel is skipped, saying so, and the rest runs.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SIGMAFAST_BACKEND", "reference")

torch.set_num_threads(1)

from helpers import (SHAKESPEARE, TIKTOKEN_CACHE, interpreter_numpy_problem,  # noqa: E402  (after TRITON_INTERPRET)
                     load_prepare_script, small_cfg)
from sigmafast.data import gpt2_encoding  # noqa: E402
from sigmafast.kernels import TritonUnavailable, support, triton_problem  # noqa: E402
from sigmafast.train import train  # noqa: E402

_TRITON_PROBLEM = triton_problem()  # read before any test patches it


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``-n auto`` when pytest-xdist is installed and the command line chose no ``-n`` (nor ``--pdb``): this
    hook runs before xdist's own, which turns it into one worker per core. Never inside a worker, nor in a
    pytest that a test starts (it inherits ``PYTEST_XDIST_WORKER``)."""
    if (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) is None
            and not os.environ.get("PYTEST_XDIST_WORKER") and not config.getoption("usepdb", False)):
        config.option.numprocesses = "auto"


def pytest_configure(config):
    """Stop before the first test, saying why, where Triton's interpreter cannot run the kernels with the
    installed NumPy (``helpers.interpreter_numpy_problem``), rather than fail nearly every kernel test."""
    if os.environ.get("TRITON_INTERPRET") == "1" and _TRITON_PROBLEM is None:
        import numpy

        problem = interpreter_numpy_problem(support.installed_triton()[0], numpy.__version__)
        if problem is not None:
            raise pytest.UsageError(problem)


def _skip_without_triton(call):
    """Run a test phase; skip the test if it needs the Triton kernels and this triton cannot run them (older
    than ``kernels.MIN_TRITON``: torch 2.4 to 2.7's), so that the rest of the suite still runs there."""
    try:
        return (yield)
    except Exception as e:
        if _TRITON_PROBLEM is None:  # a usable triton: every error is the test's
            raise
        cause = e
        while cause is not None and not isinstance(cause, TritonUnavailable):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        pytest.skip(f"{call}: {cause}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _skip_without_triton("setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _skip_without_triton("test"))


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A checkpoint of a 2-step permutation run (helpers.small_cfg), one per test module."""
    out = tmp_path_factory.mktemp("trained")
    torch.set_num_threads(1)
    train(small_cfg(out, max_iters=2))
    return out


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every ``torch.empty``/``empty_like`` of the launchers (outputs and split-V partials) comes filled
    with NaN (floats) or a huge value (ints), so that an element the kernels forget to write shows up."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else -(2**30) if t.dtype != torch.bool else True)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k)))


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine run fastest (and reproducibly) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shakespeare():
    """../shared/data/tinyshakespeare.txt (skips when absent)."""
    if not SHAKESPEARE.is_file():
        pytest.skip(f"offline data set {SHAKESPEARE} is absent (../shared/data/tinyshakespeare.txt)")
    return SHAKESPEARE


@pytest.fixture
def enc(monkeypatch):
    """GPT-2's BPE from $TIKTOKEN_CACHE_DIR, or else ../shared/tiktoken, offline (skips when absent)."""
    if not TIKTOKEN_CACHE.is_dir():
        pytest.skip(f"GPT-2 BPE cache {TIKTOKEN_CACHE} is absent ($TIKTOKEN_CACHE_DIR, or else ../shared/tiktoken): "
                    f"tiktoken cannot load offline")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    return gpt2_encoding()


@pytest.fixture(scope="session")
def shakespeare_bins(tmp_path_factory):
    """Shakespeare prepared once per session with prepare_owt.py --from-text (read-only to its users)."""
    if not SHAKESPEARE.is_file() or not TIKTOKEN_CACHE.is_dir():
        pytest.skip(f"{SHAKESPEARE} or the GPT-2 BPE cache {TIKTOKEN_CACHE} is absent")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
        data_dir = tmp_path_factory.mktemp("owt")
        assert load_prepare_script().main(["--from-text", str(SHAKESPEARE), "--data-dir", str(data_dir)]) == 0
    return data_dir
