"""Launching compiled Triton kernels without Triton's per-call binding.

``kernel[grid](*args, **kwargs)`` runs ``JITFunction.run`` on every call: it
specialises each argument (a tensor's dtype and 16-byte alignment, an
integer's range, divisibility by 16 and equality to 1), hashes that with the
keyword arguments and looks the compiled kernel up. For the fused kernels' ~50
arguments that is ~22 us a launch on a 2-core CPU, as much per forward as all
of the op's own Python (BENCHMARKS.md, "Host time per call"), and a call that
waits for its result pays it before its kernels start.

``launcher(kernel)[grid](*args, **kwargs)`` does that once per call key and
then launches the remembered ``CompiledKernel`` with the lines that end
``JITFunction.run`` (its ``run`` with every parameter in the kernel's order,
constexprs included, on the current stream, with Triton's launch metadata and
hooks where a hook is set; the same in triton 3.6 and 3.9, and
``tests/test_triton_launch.py`` checks them, hooks included, against Triton's
own path). Without hooks the tensors go as their addresses (``data_ptr``):
Triton's C launcher takes an int as the address, where for each tensor it calls
``data_ptr`` and asks the driver about the address (``cuPointerGetAttribute``);
on an H200, about 9 us less host time a launch (BENCHMARKS.md, "Stop 54"). The key
is at least as fine as Triton's specialisation, so it never meets a kernel
compiled for other arguments: each tensor's dtype and whether its address is a
multiple of 16, the value of every other argument (all that Triton specialises
an integer on is a function of its value), the keyword arguments (constexprs,
and options such as num_warps) and the current device. A key's first call goes
through ``JITFunction.run``, which compiles if need be; so does every call of a
kernel with pre-run hooks. What is left out of Triton's per-call work: the
check that the kernel's global constants have not changed since it was compiled
(ours are module constants) and re-reading the debug knobs (process settings).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

# Every launch of the library's kernels passes these compile options. Fused multiply-adds
# (FP fusion) are how the kernels were written and timed: each pair's exp2 argument
# s * scale_log2 - shift is one FMA (triton_kernels' module docstring), one rounding
# instead of two. Triton 3.9 warns where a launch leaves it unset and says 3.10 turns the
# default off; 3.6 and 3.9 keep an explicit option, and from 3.9
# TRITON_FORCE_DISABLE_FP_FUSION=1 still turns it off.
COMPILE_OPTIONS = {"enable_fp_fusion": True}

# Call keys kept per kernel: a key holds shapes and strides, not addresses, so a training
# run has a handful; past this many the oldest goes (Triton still has its kernel).
MAX_KEYS = 256


class Launcher:
    """``Launcher(kernel)[grid](*args, **kwargs)`` launches as ``kernel[grid](*args,
    **kwargs)`` would (module docstring). Its calls pass their tensors first (the fused
    kernels' pointers), then numbers: the key takes each group as a whole."""

    def __init__(self, kernel: Any) -> None:
        # triton is optional: imported where a compiled kernel exists
        from triton import knobs
        from triton.runtime import driver

        self.kernel, self._knobs, self._driver = kernel, knobs, driver
        # how many leading arguments are tensors, from the first call; None: not yet
        self._tensors: Optional[int] = None
        # call key -> (the compiled kernel, the names of the parameters after the positional
        # arguments, in the kernel's order: each one given by keyword)
        self._compiled: Dict[Tuple, Tuple[Any, Tuple[str, ...]]] = {}

    def __getitem__(self, grid: Tuple[int, ...]) -> Callable[..., None]:
        # three grid dimensions, as JITFunction.run hands them to the compiled kernel
        return functools.partial(self._launch, tuple(grid) + (1,) * (3 - len(grid)))

    def _launch(self, grid: Tuple[int, int, int], *args: Any, **kwargs: Any) -> None:
        if self._tensors is None:
            self._tensors = _leading_tensors(args)
        device = self._driver.active.get_current_device()
        key, addresses = _call_key(device, self._tensors, args, kwargs)
        try:
            found = self._compiled.get(key) if key is not None else None
        except TypeError:  # an unhashable argument: no key
            key = found = None
        if found is not None and not self.kernel.pre_run_hooks:
            compiled, tail = found
            rest = (*args[self._tensors:], *[kwargs[name] for name in tail])
            # what JITFunction.run does once it has the compiled kernel
            stream = self._driver.active.get_current_stream(device)
            hooks = self._knobs.runtime
            enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
            if _idle(enter) and _idle(leave):
                # the launch metadata is for the hooks alone, and the launcher calls no hook
                # given as None: where none is set, the same launch without building it. The
                # tensors go as their addresses: Triton's C launcher takes an int as the
                # address itself, where for a tensor it calls its data_ptr and asks the
                # driver about the address (cuPointerGetAttribute), pointer by pointer
                compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None,
                             None, None, *addresses, *rest)
            else:
                # a hook may read the launch's tensors (a profiler's bytes moved): as Triton
                params = (*args[:self._tensors], *rest)
                compiled.run(*grid, stream, compiled.function, compiled.packed_metadata,
                             compiled.launch_metadata(grid, stream, *params), enter, leave,
                             *params)
            return
        compiled = self.kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # compiled asynchronously (a triton 3.6 knob)
            compiled = compiled.result()
        tail = tuple(self.kernel.arg_names[len(args):])
        if (key is None or compiled is None or not all(name in kwargs for name in tail)
                or any(isinstance(arg, torch.Tensor) for arg in args[self._tensors:])):
            return  # not keyed by the rule above: Triton's own path, every call
        if len(self._compiled) >= MAX_KEYS:
            del self._compiled[next(iter(self._compiled))]
        self._compiled[key] = (compiled, tail)


def _idle(hook: Any) -> bool:
    """Whether a launch hook of Triton's knobs calls nothing: None, or an empty HookChain
    (triton 3.6 and 3.9 hold one of these, empty unless a profiler adds to it)."""
    return hook is None or getattr(hook, "calls", None) == []


def _leading_tensors(args: Sequence[Any]) -> int:
    """How many of `args` are tensors before the first that is not."""
    count = 0
    while count < len(args) and isinstance(args[count], torch.Tensor):
        count += 1
    return count


def _call_key(device: int, tensors: int, args: Sequence[Any], kwargs: Dict[str, Any]
              ) -> Tuple[Optional[Tuple], Optional[List[int]]]:
    """What Triton's specialisation of a call is a function of (module docstring), and the
    first `tensors` arguments' addresses; (None, None) where they are not all tensors."""
    try:
        addresses = [arg.data_ptr() for arg in args[:tensors]]
        key = (device, tuple(kwargs.items()), len(args), args[tensors:],
               *[(arg.dtype, address % 16 == 0) for arg, address in zip(args, addresses)])
    except AttributeError:
        return None, None
    return key, addresses


_LAUNCHERS: Dict[Any, Launcher] = {}


def launcher(kernel: Any) -> Any:
    """`kernel`'s Launcher where it is a compiled Triton kernel (a ``JITFunction``);
    `kernel` itself otherwise: an interpreted kernel, which has nothing compiled to keep,
    or a stand-in that records or stubs launches."""
    if type(kernel).__name__ != "JITFunction":
        return kernel
    found = _LAUNCHERS.get(kernel)
    if found is None:
        found = _LAUNCHERS[kernel] = Launcher(kernel)
    return found


def forget() -> None:
    """Drop every kept compiled kernel: the next launches bind through JITFunction.run."""
    _LAUNCHERS.clear()
