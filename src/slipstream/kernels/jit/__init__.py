"""The ``@triton.jit`` kernels, kept apart from the op files for two reasons.

* Triton is optional (``slipstream[kernels]``): importing ``slipstream.kernels`` must work without it,
  and only these modules ``import triton``.
* ``@triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
  (``TRITON_INTERPRET=1``), so decorating on first launch, not at ``import slipstream``, lets tests and
  users set the switch any time before the first kernel runs.

Each op file (``cross_entropy.py``, ``norms.py``, ``activations.py``) holds the launch settings and
the ``autograd.Function`` for the kernels of the same name here.
"""
