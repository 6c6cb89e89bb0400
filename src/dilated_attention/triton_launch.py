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

A call's launches (the fused op's forward: one per tile height, then the rule's)
repeat with every call of the same shapes, and building their ~50 arguments and
keys was most of a call's host time after validation. ``Recipes`` keeps them
whole: ``recipes.replay(key, tensors)`` launches again what ``recipes.recorder(
key, tensors, kept)`` saw for that key, each compiled kernel with its grid and
its numbers as recorded, the tensors' addresses taken from the new `tensors`
(which must be the very objects the launches passed). The caller's key names
what decided the numbers but the tensors (plans, tile sizes, flags); the
recipe's key adds each tensor's dtype, shape, strides and 16-byte alignment,
which of them share an address, and the devices. A launch's other tensors (a
plan's tables) must live in the storages of `kept`, which the recipe holds; a
launch that passed any other tensor, or that went through ``JITFunction.run``,
is not kept. A replay checks
the launch hooks as a kept launch does, and launches nothing where one is set.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

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

    def _launch(self, grid: Tuple[int, int, int], *args: Any, **kwargs: Any
                ) -> Optional[Tuple[Any, Tuple[Any, ...]]]:
        """Launch; (the compiled kernel, the arguments after the tensors) where it went as a
        kept launch of addresses (what a recipe can launch again), else None."""
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
                return compiled, rest
            else:
                # a hook may read the launch's tensors (a profiler's bytes moved): as Triton
                params = (*args[:self._tensors], *rest)
                compiled.run(*grid, stream, compiled.function, compiled.packed_metadata,
                             compiled.launch_metadata(grid, stream, *params), enter, leave,
                             *params)
            return None
        compiled = self.kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # compiled asynchronously (a triton 3.6 knob)
            compiled = compiled.result()
        tail = tuple(self.kernel.arg_names[len(args):])
        if (key is None or compiled is None or not all(name in kwargs for name in tail)
                or any(isinstance(arg, torch.Tensor) for arg in args[self._tensors:])):
            return None  # not keyed by the rule above: Triton's own path, every call
        if len(self._compiled) >= MAX_KEYS:
            del self._compiled[next(iter(self._compiled))]
        self._compiled[key] = (compiled, tail)
        return None


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


def _addresses(tensors: Sequence[Any]) -> List[int]:
    """The tensors' addresses (AttributeError for anything but a tensor)."""
    return [tensor.data_ptr() for tensor in tensors]


def _call_key(device: int, tensors: int, args: Sequence[Any], kwargs: Dict[str, Any]
              ) -> Tuple[Optional[Tuple], Optional[List[int]]]:
    """What Triton's specialisation of a call is a function of (module docstring), and the
    first `tensors` arguments' addresses; (None, None) where they are not all tensors."""
    try:
        addresses = _addresses(args[:tensors])
        key = (device, tuple(kwargs.items()), len(args), args[tensors:],
               *[(arg.dtype, address % 16 == 0) for arg, address in zip(args, addresses)])
    except AttributeError:
        return None, None
    return key, addresses


class _Replayed(NamedTuple):
    """One launch of a recipe: the compiled kernel, its grid, its tensors' addresses as
    picked from the call's addresses followed by the recipe's own, its other arguments."""

    compiled: Any
    grid: Tuple[int, int, int]
    pick: Callable[[Sequence[int]], Tuple[int, ...]]
    rest: Tuple[Any, ...]


class _Recipe(NamedTuple):
    launches: Tuple[_Replayed, ...]
    addresses: Tuple[int, ...]  # of the tensors in `kept`, which a launch passed
    kept: Tuple[Any, ...]  # what holds those tensors' storage


class Recipes:
    """A call's launches kept whole per key (module docstring): ``replay`` launches them
    again with another call's tensors, ``recorder`` records them. Bounded: past `size`
    keys the oldest goes."""

    def __init__(self, size: int = MAX_KEYS) -> None:
        self._size = size
        self._recipes: Dict[Hashable, _Recipe] = {}

    def replay(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> bool:
        """Launch what `key`'s recipe holds with `tensors`; False (nothing launched) where
        there is none, or a launch hook is set."""
        if not self._recipes:  # nothing recorded (interpreted kernels never are)
            return False
        from triton import knobs
        from triton.runtime import driver

        device = driver.active.get_current_device()
        addresses = _addresses(tensors)
        recipe = self._recipes.get(_recipe_key(key, device, tensors, addresses))
        hooks = knobs.runtime
        if recipe is None or not (_idle(hooks.launch_enter_hook)
                                  and _idle(hooks.launch_exit_hook)):
            return False
        pool = addresses + list(recipe.addresses)
        stream = driver.active.get_current_stream(device)
        for compiled, grid, pick, rest in recipe.launches:
            compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None,
                         None, *pick(pool), *rest)
        return True

    def recorder(self, key: Hashable, tensors: Sequence[torch.Tensor],
                 kept: Sequence[Any]) -> "Recorder":
        """A Recorder of a call's launches under `key`: `tensors` the call's own; `kept`
        tensors, or tuples of them (a plan), that the recipe holds, which must hold
        the storage of every other tensor a launch passes (a plan's tables, or views of
        them). Whatever the caller's key names by identity (id()) goes in `kept`, so that
        no other object takes its id while the recipe lives."""
        return Recorder(self, key, tensors, kept)

    def _keep(self, key: Hashable, recipe: _Recipe) -> None:
        if len(self._recipes) >= self._size:
            del self._recipes[next(iter(self._recipes))]
        self._recipes[key] = recipe

    def clear(self) -> None:
        self._recipes.clear()


class Recorder:
    """``recorder(kernel)[grid](*args, **kwargs)`` launches as ``launcher(kernel)`` does and
    records it; ``keep()`` then keeps the call's recipe, where every launch was a kept
    launch of addresses whose tensors are the call's or live in `kept`."""

    def __init__(self, recipes: Recipes, key: Hashable, tensors: Sequence[torch.Tensor],
                 kept: Sequence[Any]) -> None:
        self._recipes, self._key, self._tensors, self._kept = recipes, key, tensors, kept
        self._storages: Optional[set] = None  # of the kept tensors, when a launch asks
        self._launches: List[_Replayed] = []
        self._addresses: List[int] = []
        self._keepable = True

    def __call__(self, kernel: Any) -> Any:
        found = launcher(kernel)
        if not isinstance(found, Launcher):
            self._keepable = False
            return found
        return _Recording(self, found)

    def _record(self, found: Launcher, grid: Tuple[int, int, int], *args: Any,
                **kwargs: Any) -> None:
        launched = found._launch(grid, *args, **kwargs)
        if launched is None or not self._keepable:
            self._keepable = False
            return
        slots = []
        for arg in args[:found._tensors]:
            slot = next((i for i, tensor in enumerate(self._tensors) if tensor is arg), None)
            if slot is None:
                if arg.untyped_storage().data_ptr() not in self._kept_storages():
                    self._keepable = False  # a tensor of this call alone: nothing to replay
                    return
                slot = len(self._tensors) + len(self._addresses)
                self._addresses.append(arg.data_ptr())
            slots.append(slot)
        self._launches.append(_Replayed(launched[0], grid, _picker(slots), launched[1]))

    def _kept_storages(self) -> set:
        """The storages of the kept tensors (a tuple's tensors included), found once: a call
        whose launches cannot be kept (interpreted ones: every call on CPU) never asks."""
        if self._storages is None:
            self._storages = {tensor.untyped_storage().data_ptr()
                              for item in self._kept
                              for tensor in (item if isinstance(item, tuple) else (item,))
                              if isinstance(tensor, torch.Tensor)}
        return self._storages

    def keep(self) -> None:
        """Keep the recorded launches as the key's recipe, if they can be replayed."""
        if not (self._keepable and self._launches):
            return
        from triton.runtime import driver

        key = _recipe_key(self._key, driver.active.get_current_device(), self._tensors,
                          _addresses(self._tensors))
        self._recipes._keep(key, _Recipe(tuple(self._launches), tuple(self._addresses),
                                         tuple(self._kept)))


class _Recording:
    def __init__(self, recorder: Recorder, found: Launcher) -> None:
        self._recorder, self._found = recorder, found

    def __getitem__(self, grid: Tuple[int, ...]) -> Callable[..., None]:
        return functools.partial(self._recorder._record, self._found,
                                 tuple(grid) + (1,) * (3 - len(grid)))


def _picker(slots: Sequence[int]) -> Callable[[Sequence[int]], Tuple[int, ...]]:
    """pool -> the pool's entries at `slots`, as a tuple (itemgetter returns one entry bare)."""
    if len(slots) == 1:
        (slot,) = slots
        return lambda pool: (pool[slot],)
    return operator.itemgetter(*slots)


def _recipe_key(key: Hashable, device: int, tensors: Sequence[torch.Tensor],
                addresses: List[int]) -> Tuple:
    """A recipe's key: the caller's, the current device, the tensors' device (the first's:
    a call's are on one), which tensors share an address (``_shared``), and per tensor what
    the launches' numbers or Triton's specialisation could read of it."""
    return (key, device, tensors[0].device, _shared(addresses),
            *[(tensor.dtype, tensor.shape, tensor.stride(), address % 16 == 0)
              for tensor, address in zip(tensors, addresses)])


def _shared(addresses: List[int]) -> Tuple[int, ...]:
    """Per tensor, the first place its address holds: a recorder takes a launch's tensor as
    the first of the call's that it is, so a call whose q is its k records k's launches with
    q's address, which a call with a k of its own must not replay. (The list's own index:
    a dict or a set first took longer, as a call's lse fills several places.)"""
    return tuple(map(addresses.index, addresses))


_LAUNCHERS: Dict[Any, Launcher] = {}
# as many as fused_plan keeps plans of each kind: a recipe holds its plans (their tables on
# the device)
RECIPES = Recipes(size=64)


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
    """Drop every kept compiled kernel and recipe: the next launches bind through
    JITFunction.run."""
    _LAUNCHERS.clear()
    RECIPES.clear()
