"""Test-session setup.

``TRITON_INTERPRET=1`` must be set before triton is imported so that the
Triton kernels run in the interpreter on CPU. The default kernel backend of
the session stays the PyTorch reference; kernel tests call the Triton ops
directly or inside ``sigmafast.kernels.use_backend("triton")``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SIGMAFAST_BACKEND", "reference")
