"""OpenAI Triton kernels, each beside the plain torch reference it is tested against.

Without CUDA, compiled Triton kernels cannot run, but Triton's interpreter (TRITON_INTERPRET=1)
runs them on CPU tensors. Triton reads that variable when it is first imported (its own tl.min,
tl.argmax, ... are @triton.jit functions), so it is set here, before any kernel module imports
triton. A process that imported triton earlier keeps compiled kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
