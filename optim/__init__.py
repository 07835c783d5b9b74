"""cukit.optim: fused multi-tensor optimizers (drop-in for ``torch.optim``).

Installed from the top-level ``optim/`` directory as ``cukit.optim`` (setuptools package-dir).
The optimizers land with the multi-tensor engine (raw_kernels/include/cukit/multi_tensor.cuh).
"""

__all__: list[str] = []
