"""The installed package layout: kernels/ ships as sigmafast.kernels only."""

import importlib


def test_kernels_is_a_subpackage():
    kernels = importlib.import_module("sigmafast.kernels")
    reference = importlib.import_module("sigmafast.kernels.reference")
    assert kernels.__name__ == "sigmafast.kernels"
    assert callable(reference.burst_attention)
    for name in ("burst_attention", "verify_attention", "acceptance", "sample", "residual_sample"):
        assert callable(getattr(kernels, name)), name

