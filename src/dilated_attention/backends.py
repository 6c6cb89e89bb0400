"""Which kernel computes a piece of attention: the names, what each needs, what "auto" picks.

``select_backend`` resolves a call's ``backend=`` once, when the public op
validates the call (kernels.py then runs the chosen kernel for every
launch); a kernel named explicitly that cannot run the call (device, dtype,
dropout, a key padding mask, a missing package) is a ValueError saying what
it needs. docs/backends.md says what "auto" picks and why.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Dict, List, Optional, Tuple

import torch

from . import fused  # its tile tables (no triton: that is imported by its launches)
from .releases import installed_release

BACKENDS = ("auto", "cpu_flash", "cuda_cudnn", "cuda_flash", "cuda_efficient", "flash_attn",
            "blockwise", "triton")
# the kernels that honour a key padding mask
MASKED_BACKENDS = ("auto", "cpu_flash", "blockwise", "triton")

# flash-attn and triton are optional: looked up once (an import inside select_backend would
# break torch.compile's graph), imported only by the launches that use them
_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _interpreter_problem(triton: Tuple[int, ...], numpy: Tuple[int, ...]) -> Optional[str]:
    """What Triton's interpreter (CPU tensors) lacks to run the fused kernels, given the
    (major, minor) releases of triton and numpy, or None. Checked by running
    tests/test_fused.py: triton 3.0 and 3.1's interpreter refuses tl.arange of a helper's
    constexpr argument; before 3.7 it takes a loaded loop bound as int() of a 1-element
    array, which numpy 2.4 refuses (3.2, 3.4 and 3.5 ran them beside numpy 2.3, 3.7-3.9
    beside 2.4).
    Compiled kernels (CUDA) are not affected."""
    def release(version: Tuple[int, ...]) -> str:
        return ".".join(map(str, version))

    if not triton or not numpy:
        return None
    if triton < (3, 2):
        return (f"triton 3.2 or newer for Triton's interpreter (got {release(triton)}, whose "
                f"interpreter cannot run these kernels)")
    if triton < (3, 7) and numpy >= (2, 4):
        return (f"triton 3.7 or newer for Triton's interpreter beside numpy 2.4 or newer "
                f"(got triton {release(triton)} and numpy {release(numpy)}: that interpreter "
                f"cannot run these kernels' loops; or numpy<2.4)")
    return None


_INTERPRETER_PROBLEM = _interpreter_problem(installed_release("triton"),
                                            installed_release("numpy"))

# The dtypes for which backend="auto" runs a whole dilated op on one device (a single-device
# call, or a Ulysses rank's heads over all rows) with the fused Triton kernel (fused.py:
# every pattern in one pass), per device; and a sequence-parallel rank's own pairs. CUDA:
# fp16/bf16, measured on an H100 faster than the SDPA path at every length from 8K to 1M
# tokens, LongNet's setting and the geometric schedule, forward and forward + backward
# (BENCHMARKS.md, "One H100"); fp32 (TF32 or full-precision products) is not measured there.
# The exchange's launches on received keys keep the SDPA kernels: as a plain attention kernel
# the fused one is slower than cuDNN's. On CPU the interpreter is a test vehicle, never the
# fast path.
FUSED_BY_DEFAULT: Dict[str, Tuple[torch.dtype, ...]] = {
    "cpu": (), "cuda": (torch.float16, torch.bfloat16)}


@dataclasses.dataclass(frozen=True)
class _Needs:
    """What a kernel chosen by name needs to run (checked before any launch)."""

    devices: Tuple[str, ...]
    dtypes: Tuple[torch.dtype, ...]
    capability: Optional[Tuple[int, int]] = None  # minimum CUDA compute capability
    package: Optional[str] = None  # an optional dependency, by its pip name
    # CPU tensors run Triton's interpreter: TRITON_INTERPRET=1, and its dtypes only
    interpreted_on_cpu: Tuple[torch.dtype, ...] = ()

    def unmet(self, device: torch.device, dtype: torch.dtype) -> List[str]:
        """Each requirement `device` and `dtype` miss, in words (empty when all are met)."""
        unmet = []
        if device.type not in self.devices:
            unmet.append(f"a {_DEVICE_NAMES[self.devices[0]]} device (got {device.type})")
        if dtype not in self.dtypes:
            names = " or ".join(str(t).replace("torch.", "") for t in self.dtypes)
            unmet.append(f"{names} (got {dtype})")
        if self.capability is not None and device.type == "cuda":
            have = torch.cuda.get_device_capability(device)
            if have < self.capability:
                unmet.append(f"a GPU of compute capability {self.capability[0]}."
                             f"{self.capability[1]} or newer (got {have[0]}.{have[1]})")
        if self.package is not None and not _INSTALLED[self.package]:
            unmet.append(f"the {self.package} package installed (pip install {self.package}; "
                         f"not found)")
        if self.interpreted_on_cpu and device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") != "1":
                unmet.append(f"a CUDA device, or the environment variable TRITON_INTERPRET=1 on "
                             f"CPU tensors (Triton's interpreter; set before the first call; "
                             f"it is {os.environ.get('TRITON_INTERPRET')!r})")
            if _INTERPRETER_PROBLEM is not None:
                unmet.append(_INTERPRETER_PROBLEM)
            if dtype in self.dtypes and dtype not in self.interpreted_on_cpu:
                names = " or ".join(str(t).replace("torch.", "") for t in self.interpreted_on_cpu)
                unmet.append(f"{names} on CPU (got {dtype}: the interpreter's {dtype} matrix "
                             f"products are wrong)")
        return unmet


_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA"}
_INSTALLED = {"flash-attn": _HAS_FLASH_ATTN, "triton": _HAS_TRITON}
# meta tensors (shape-only runs: estimate --dry-run) stand in for any device
_NEEDS = {
    "cpu_flash": _Needs(("cpu", "meta"), _FLOATS),
    "cuda_cudnn": _Needs(("cuda", "meta"), _HALF, capability=(9, 0)),
    "cuda_flash": _Needs(("cuda", "meta"), _HALF, capability=(8, 0)),
    "cuda_efficient": _Needs(("cuda", "meta"), _HALF + (torch.float32,)),
    "flash_attn": _Needs(("cuda",), _HALF, capability=(8, 0), package="flash-attn"),
    # its tiles are checked for sm_80 and newer (fused.CUDA_TILE_SIZES)
    "triton": _Needs(("cuda", "cpu", "meta"), (torch.float32,) + _HALF, capability=(8, 0),
                     package="triton", interpreted_on_cpu=(torch.float32, torch.float16)),
}


def select_backend(
    device: torch.device, dtype: torch.dtype, *, dropout_p: float = 0.0, backend: str = "auto",
    masked: bool = False, head_dim: Optional[int] = None, whole_op: bool = False,
) -> str:
    """Pick the fastest kernel that supports `device`, `dtype`, dropout and key masks.

    whole_op: the call computes the whole dilated op on this device (not sequence-parallel
    launches, nor a dense block): where auto may run the fused kernel (FUSED_BY_DEFAULT).
    head_dim: the call's, where known (the fused kernel takes at most fused.MAX_HEAD_DIM).

    Runs when the public op validates a call (inside the cross-rank
    agreement: an error is raised on every rank; a call whose signature was
    checked before reuses its choice, ``validation.CheckedCalls``); the call's
    launches then run the chosen kernel (`KernelOptions.backend`). A kernel
    named by `backend` is checked here, before any launch, so that a call it
    cannot run is a ValueError saying what it needs, not an error from deep
    inside aten.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dropout_p > 0.0 and backend not in ("auto", "blockwise", "triton"):
        # the other kernels are called with dropout 0: refuse rather than silently not drop
        raise ValueError(
            f"backend {backend!r} does not support dropout (dropout_p={dropout_p}); "
            f"use backend='blockwise', 'triton' or 'auto'"
        )
    if masked and backend not in MASKED_BACKENDS:
        raise ValueError(
            f"backend {backend!r} does not take a key padding mask; use one of "
            f"{MASKED_BACKENDS}"
        )
    needs = _NEEDS.get(backend)
    unmet = [] if needs is None else needs.unmet(torch.device(device), dtype)
    if backend == "triton" and head_dim is not None and head_dim > fused.MAX_HEAD_DIM:
        unmet.append(f"a head dim of at most {fused.MAX_HEAD_DIM} (got {head_dim})")
    if unmet:
        raise ValueError(
            f"backend {backend!r} needs {'; '.join(unmet)}; backend='auto' picks a kernel "
            f"that runs here, backend='blockwise' runs on any device and dtype"
        )
    if backend != "auto":
        return backend
    if dropout_p > 0.0:
        # Only the blockwise kernel can replay the same dropout mask in backward.
        return "blockwise"
    if (whole_op and dtype in FUSED_BY_DEFAULT.get(device.type, ()) and _HAS_TRITON
            and (head_dim is None or head_dim <= fused.MAX_HEAD_DIM)
            and not _NEEDS["triton"].unmet(torch.device(device), dtype)):
        return "triton"
    if masked:
        # the CPU flash op takes an additive mask; the CUDA paths with one are not verified
        # on a GPU yet, so masked calls there run the pure-PyTorch kernel
        return "cpu_flash" if device.type in ("cpu", "meta") else "blockwise"
    if device.type in ("cpu", "meta"):
        # the CPU flash op has meta kernels: shape-only runs (estimate --dry-run) stay fast
        return "cpu_flash"
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16):
            capability = torch.cuda.get_device_capability(device)
            if capability >= (9, 0):
                # cuDNN's kernel: measured on an H100 (bf16, d 64) 1.4x the flash op's speed
                return "cuda_cudnn"
            if _HAS_FLASH_ATTN and capability >= (8, 0):
                return "flash_attn"
            if capability >= (8, 0):
                return "cuda_flash"
        if dtype in (torch.float16, torch.bfloat16, torch.float32):
            return "cuda_efficient"
    # float64 on CUDA, other devices
    return "blockwise"


def recommended_dtype(device) -> torch.dtype:
    """The fastest accurate-enough dtype for attention on `device`.

    CUDA: float32 on GPUs older than compute capability 7.0 (half precision
    is slow there), bfloat16 where the GPU supports it (8.0+), else float16.
    Other devices: float32 (CPU half-precision kernels gain little or lose).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    capability = torch.cuda.get_device_capability(device)
    if capability < (7, 0):
        return torch.float32
    # native bf16 from Ampere (8.0) on; is_bf16_supported() also admits emulation
    return torch.bfloat16 if capability >= (8, 0) else torch.float16
