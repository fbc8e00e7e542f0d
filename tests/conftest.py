"""Test-session setup.

Without a CUDA device, ``TRITON_INTERPRET=1`` is set (before triton is
imported) so that the Triton kernels run in the interpreter on CPU; with one,
the kernels compile for the GPU as in production. The default kernel backend
of the session stays the PyTorch reference; kernel tests call the Triton ops
directly or inside ``sigmafast.kernels.use_backend("triton")``.

The tests use tiny tensors, for which PyTorch's intra-op thread pool costs more
than it saves on a small shared CPU, so the session runs single-threaded.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SIGMAFAST_BACKEND", "reference")

torch.set_num_threads(1)
