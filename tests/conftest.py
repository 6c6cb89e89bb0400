"""Shared test settings: a deterministic hypothesis profile, one intra-op thread, and
Triton's interpreter where there is no GPU."""

import os

import torch
from hypothesis import settings

# backend="triton" runs on CPU tensors through Triton's interpreter, which @triton.jit
# picks when the kernels are created: set the variable before anything imports them (and
# before spawned ranks start: they inherit it). With a GPU the kernels are compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# derandomize: the same examples on every run (tests must be deterministic);
# no deadline: the CPU is shared and timings vary; no example database on disk.
settings.register_profile("dilated", deadline=None, derandomize=True, database=None)
settings.load_profile("dilated")

# Test tensors are tiny: with two OpenMP threads on a busy 2-core machine the
# CPU flash op spends ~10 ms per call waiting at barriers, 30x its 1-thread time.
torch.set_num_threads(1)
