"""Argument checks shared by the functional ops and the modules.

Every error names the argument and the offending value. One check per kind of argument,
called by every public entry point that takes one, so a value is taken or refused alike
everywhere, in the same words: sizes and dims (``check_int``) are Python or NumPy ints, as
torch takes them, not bools, floats or tensors; reals (``check_real``: scales, probabilities,
temperatures) are Python or NumPy numbers, not bools or tensors, NaN outside every range;
flags (``check_bool``) are bools only, as ``F.scaled_dot_product_attention``'s is_causal;
lists (``check_patterns``, ``check_cu_seqlens``) are sequences of such ints, not arrays or
generators (cu_seqlens also an int tensor); a sliding window is ``check_window``'s
(flash-attn's (left, right), each side an int as above; every problem a ValueError); the
padding masks are ``check_key_padding_mask`` (bool, True = ignore) and
``check_attention_mask`` (0/1, 1 = a real token); positions ``check_position_ids``'s
(an integer tensor); a group is ``distributed.comm.resolve_group``'s.
"""

from __future__ import annotations

import math
import numbers
import os
import types
from typing import Any, Callable, Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .backends import BACKENDS

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# the largest row count or stride torch can index (int64)
INDEX_MAX = 2**63 - 1


def check_int(name: str, value, what: str = "an int") -> int:
    """An int as torch takes one for a size or a dim: a Python or NumPy int, as an int. A
    bool (True is no size), a float (even 2.0) or a tensor (its value is data: a read-back
    from the device, a graph break under torch.compile) is a TypeError naming `name`
    ("`name` must be `what`, got ...")."""
    if type(value) is not int:  # a plain int skips the ABC checks (a bool's type is bool)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
        value = int(value)
    return value


def check_positive_int(name: str, value) -> int:
    """A positive int (`check_int`), else TypeError/ValueError naming `name`."""
    value = check_int(name, value, "a positive int")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _check_index(name: str, value) -> int:
    """A positive int within int64 (a segment longer than any sequence acts as the whole
    sequence, but the value itself must still travel through torch's int64 arguments)."""
    value = check_positive_int(name, value)
    if value > INDEX_MAX:
        raise ValueError(f"{name} must be at most 2**63 - 1 = {INDEX_MAX} (torch indexes with "
                         f"int64), got {value}")
    return value


def _indices(name: str, values: Sequence) -> Tuple[int, ...]:
    """Each entry of `values` checked by _check_index, as a tuple; errors name `name[i]`."""
    values = tuple(values)
    # plain ints in range skip the per-entry calls (and their names' formatting): every call
    # of the ops checks its patterns
    if all(type(value) is int and 0 < value <= INDEX_MAX for value in values):
        return values
    return tuple(_check_index(f"{name}[{i}]", value) for i, value in enumerate(values))


def check_patterns(segment_lengths, dilation_rates) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Validate the pattern lists; return them as tuples of ints."""
    for name, seq in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if type(seq) not in (list, tuple) and (isinstance(seq, (str, bytes))
                                               or not isinstance(seq, Sequence)):
            raise TypeError(f"{name} must be a list of positive ints, got {seq!r}")
        if len(seq) == 0:
            raise ValueError(f"{name} must not be empty, got {list(seq)!r}")
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError(
            f"segment_lengths and dilation_rates must have the same length, got "
            f"{list(segment_lengths)!r} ({len(segment_lengths)}) and {list(dilation_rates)!r} "
            f"({len(dilation_rates)})"
        )
    segs, rates = _indices("segment_lengths", segment_lengths), _indices("dilation_rates",
                                                                        dilation_rates)
    for i, (w, r) in enumerate(zip(segs, rates)):
        if r > w:
            raise ValueError(
                f"dilation_rates[{i}] = {r} exceeds segment_lengths[{i}] = {w}; a rate must be "
                f"at most its segment length"
            )
    return segs, rates


def check_real(name: str, value, what: str, within: Callable[[Any], bool]) -> float:
    """A real number for which `within` holds, as a float: a Python or NumPy float or int,
    as torch takes one for a scale or a probability. A bool, a string or a tensor (its value
    is data: a read-back from the device) is a TypeError, a value outside (NaN included:
    `within` compares it False) a ValueError, each "`name` must be `what`, got ..."."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    if not within(value):
        raise ValueError(f"{name} must be {what}, got {value}")
    return float(value)


def check_dropout(dropout_p, name: str = "dropout_p") -> float:
    """A dropout probability in [0, 1); errors call it `name` (the caller's argument)."""
    return check_real(name, dropout_p, "a float in [0, 1)", lambda p: 0.0 <= p < 1.0)


# How a sequence-parallel call spreads over its ranks (distributed/strategy.py).
STRATEGIES = ("auto", "exchange", "ulysses")


def check_strategy(strategy: Any) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def check_backend(backend: Any) -> str:
    """A kernel name the ops know (whether it runs on given inputs is checked per call,
    ``backends.select_backend``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_positive_float(name: str, value) -> float:
    """A positive finite real (`check_real`), as a float; else TypeError/ValueError naming
    `name`."""
    return check_real(name, value, "a positive finite float",
                      lambda x: math.isfinite(x) and x > 0)


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: `scale` if given (positive, finite), else 1/sqrt(d)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_positive_float("scale", scale)


def check_module_dtype(dtype) -> Optional[torch.dtype]:
    """A module's or model's parameter dtype: None (torch's default) or one the ops run
    (an integer dtype failed in nn.Linear, "Only Tensors of floating point ... can require
    gradients"; a complex one at the first call; a string in torch's factory)."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be None, torch.float64, float32, float16 or bfloat16, "
                        f"got {dtype!r}")
    return dtype


def check_dense(name: str, x: Tensor) -> None:
    """A plain strided tensor: the kernels index rows by strides (a sparse or nested tensor
    would fail deep inside them)."""
    if x.layout != torch.strided or x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got "
                        f"{'a nested tensor' if x.is_nested else f'layout {x.layout}'}")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, allow_empty: bool = False) -> None:
    """q (b, n, h, d), k/v (b, n, hk, d) with hk dividing h, one float dtype, one device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        check_dense(name, x)
        if x.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {tuple(x.shape)}"
            )
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be float64, float32, float16 or bfloat16, got {x.dtype}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    problem = _shape_problem(q.shape, k.shape, v.shape)
    if problem is not None:
        raise ValueError(problem + layout_hint(q.shape, k.shape, v.shape))
    if q.shape[1] == 0 and not allow_empty:
        raise ValueError(f"seq_len must be at least 1, got q shape {tuple(q.shape)}")


# torch.func transforms by the functorch interpreter that runs them. The ops are custom
# autograd ops without functorch rules: grad and vmap fail deep inside torch, and jvp
# (forward mode) silently returns zero tangents.
_TRANSFORMS = {
    torch._C._functorch.TransformType.Grad: "torch.func.grad (and vjp, jacrev, hessian)",
    torch._C._functorch.TransformType.Vmap: "torch.func.vmap",
    torch._C._functorch.TransformType.Jvp: "torch.func.jvp (and jacfwd: forward mode)",
}


def check_no_transform(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Refuse torch.func transforms and forward-mode AD, which the ops do not implement."""
    if torch.compiler.is_compiling():
        return
    for interpreter in torch._C._functorch.get_interpreter_stack() or ():
        name = _TRANSFORMS.get(interpreter.key())
        if name is not None:
            raise ValueError(
                f"dilated attention does not support {name}: its ops are custom autograd "
                f"ops without functorch rules. Take gradients with torch.autograd.grad or "
                f".backward() (with torch.func.functional_call for given parameters), and "
                f"batch through the batch dimension (dim 0) instead of vmap"
            )
    if any(forward_ad.unpack_dual(x).tangent is not None for x in (q, k, v)):
        raise ValueError(
            "dilated attention does not support forward-mode AD (dual tensors of "
            "torch.autograd.forward_ad): its tangents would be lost; use reverse mode "
            "(torch.autograd.grad or .backward())"
        )


def _shape_problem(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> Optional[str]:
    """What is wrong with 4-D shapes q (b, n, h, d), k/v (b, n, hk, d), or None."""
    for dim, what in ((0, "batch"), (1, "seq_len"), (3, "head_dim")):
        # compared, not put in a set: hashing a size that torch.compile traces as dynamic
        # specialises it to its value (one graph per sequence length)
        if not q[dim] == k[dim] == v[dim]:
            return (f"q, k, v must share {what} (dim {dim}), got q {tuple(q)}, k {tuple(k)}, "
                    f"v {tuple(v)}")
    if k[2] != v[2]:
        return f"k and v must have the same number of heads, got k {tuple(k)}, v {tuple(v)}"
    if 0 in (q[0], q[2], k[2], q[3]):
        return (f"q, k, v must have non-empty batch, heads and head_dim, got q {tuple(q)}, "
                f"k {tuple(k)}")
    if q[2] % k[2] != 0:
        return (f"q has {q[2]} heads, not a multiple of the {k[2]} key/value heads of k and v "
                f"(q {tuple(q)}, k {tuple(k)})")
    return None


def layout_hint(*shapes: Sequence[int]) -> str:
    """For an error about q, k, v `shapes` (in that order; a key padding mask's (b, n) may
    follow): a hint when the same tensors with dims 1 and 2 swapped would be valid, the
    sign of SDPA's (batch, heads, seq_len, head_dim) layout; else ""."""
    swapped = [(s[0], s[2], s[1], s[3]) for s in shapes[:3]]
    if _shape_problem(*swapped) is not None:
        return ""
    if len(shapes) > 3 and tuple(shapes[3]) != swapped[0][:2]:
        return ""
    return (" (the layout is (batch, seq_len, heads, head_dim); these look like SDPA's "
            "(batch, heads, seq_len, head_dim): pass q.transpose(1, 2), k.transpose(1, 2), "
            "v.transpose(1, 2))")


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_optional_positive_int(name: str, value: Optional[int]) -> Optional[int]:
    return None if value is None else check_positive_int(name, value)


def check_window(window_size, is_causal: bool) -> Tuple[int, int]:
    """A sliding window (left, right) of ints >= -1 (-1: unbounded on that side), flash-attn's
    convention; with `is_causal` the right side is 0 (an unbounded one becomes 0, a positive
    one is an error). Every problem is a ValueError naming window_size."""
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) \
            or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1 (-1: "
                         f"unbounded), got {window_size!r}")
    for side, value in zip(("left", "right"), window_size):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < -1:
            raise ValueError(f"window_size must be a pair (left, right) of ints >= -1 (-1: "
                             f"unbounded), got {side} = {value!r} in {tuple(window_size)!r}")
    left, right = (int(x) for x in window_size)
    if is_causal:
        if right > 0:
            raise ValueError(f"window_size = {(left, right)} looks {right} keys ahead, but "
                             f"is_causal=True attends no key after the query: pass "
                             f"window_size=({left}, 0) (or -1 on the right), or is_causal=False")
        right = 0
    return left, right


def check_cu_seqlens(cu_seqlens, name: str = "cu_seqlens") -> Optional[Tuple[int, ...]]:
    """Document boundaries [0, c1, ..., N] (an int tensor or a sequence of ints), non-decreasing.

    Returns them as a tuple of ints (None stays None). Whether the last one is
    the sequence length is checked by the caller, which knows N. Errors call them `name`
    (the caller's argument: transformers' cu_seq_lens_q).
    """
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or \
                cu_seqlens.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of {cu_seqlens.dtype}")
        if cu_seqlens.device.type == "meta":
            raise ValueError(
                f"{name} must hold values: got a tensor on the meta device (shapes only); "
                "pass a CPU or GPU tensor or a list of ints"
            )
        if cu_seqlens.dim() != 1:
            raise ValueError(
                f"{name} must be 1-D [0, c1, ..., N], got shape {tuple(cu_seqlens.shape)}"
            )
        values = tuple(int(c) for c in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Sequence):
        raise TypeError(
            f"{name} must be an int tensor or a sequence of ints, got {cu_seqlens!r}"
        )
    else:
        values = tuple(check_int(f"{name}[{i}]", c) for i, c in enumerate(cu_seqlens))
    if len(values) < 2 or values[0] != 0:
        raise ValueError(f"{name} must start at 0 and end at the sequence length, got "
                         f"{brief(values)}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i - 1}] = {values[i - 1]} > "
                f"{name}[{i}] = {values[i]} in {brief(values)}"
            )
    return values


def check_documents(cu_seqlens: Optional[Tuple[int, ...]], total: int,
                    name: str = "cu_seqlens") -> Optional[Tuple[int, ...]]:
    """Boundaries from `check_cu_seqlens` (agreed across ranks), checked to end at the sequence
    length `total`; None for one document (no boundary inside), which every op treats alike."""
    if cu_seqlens is None:
        return None
    if cu_seqlens[-1] != total:
        raise ValueError(f"{name} must end at the sequence length {total}, got {cu_seqlens[-1]} "
                         f"({name} {brief(cu_seqlens)})")
    return None if len(cu_seqlens) == 2 else cu_seqlens


def brief(values: Sequence[int]) -> str:
    """A list for an error message, elided in the middle when long."""
    if len(values) <= 8:
        return str(list(values))
    return f"[{', '.join(map(str, values[:4]))}, ..., {', '.join(map(str, values[-3:]))}]"


def check_key_padding_mask(mask, q: Tensor) -> Optional[Tensor]:
    """A bool (b, n) mask on q's device matching q (b, n, h, d), True = ignore that key."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"key_padding_mask must be a bool tensor or None, got "
                        f"{type(mask).__name__}")
    check_dense("key_padding_mask", mask)
    if mask.dtype != torch.bool:
        raise TypeError(
            f"key_padding_mask must be a bool tensor (True = ignore that key), got {mask.dtype}"
        )
    if tuple(mask.shape) != tuple(q.shape[:2]):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq_len) = {tuple(q.shape[:2])}, got "
            f"{tuple(mask.shape)}" + layout_hint(q.shape, q.shape, q.shape, mask.shape)
        )
    if mask.device != q.device:
        raise ValueError(f"key_padding_mask must be on q's device {q.device}, got {mask.device}")
    return mask


def check_attention_mask(mask, ids: Tensor, ids_name: str) -> Optional[Tensor]:
    """A padding mask in transformers' convention for token ids `ids` (b, n): None, or a
    tensor of their shape holding only 1 (a real token) and 0 (padding), of a bool, integer
    or float dtype (transformers passes all three); returned as int64. The values are
    checked as given (a float 0.5 would read as 0 once an integer). TypeError for anything
    but a real tensor; ValueError for another shape, a meta tensor (no values) or other
    values. Errors name attention_mask and what was given."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype.is_complex:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"attention_mask must be a bool, integer or float tensor of 0s "
                        f"(padding) and 1s (real tokens), got {got}")
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask must have {ids_name}' shape {tuple(ids.shape)}, got "
                         f"{tuple(mask.shape)}")
    if mask.device.type == "meta":
        raise ValueError("attention_mask must hold values: got a tensor on the meta device "
                         "(shapes only)")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (real token) only")
    return mask.long()


def check_position_ids(position_ids, batch: int, n: int) -> Tensor:
    """Positions of (batch, n) tokens, as transformers takes them: an integer tensor (not a
    bool one: no positions 0/1) of shape (n,), (1, n) or (batch, n), returned as (rows, n).
    TypeError for another kind, ValueError for another shape or a meta tensor (no values);
    what the positions mean (documents, their range) is the caller's."""
    if not isinstance(position_ids, Tensor) or position_ids.dtype.is_floating_point or \
            position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
        got = f"a {position_ids.dtype} tensor" if isinstance(position_ids, Tensor) else \
            type(position_ids).__name__
        raise TypeError(f"position_ids must be an integer tensor, got {got}")
    rows = position_ids[None] if position_ids.dim() == 1 else position_ids
    if rows.dim() != 2 or rows.shape[1] != n or rows.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must be (seq_len,), (1, seq_len) or (batch, seq_len) "
                         f"for (batch, seq_len) = {(batch, n)}, got {tuple(position_ids.shape)}")
    if rows.device.type == "meta":
        raise ValueError("position_ids must hold values: got a tensor on the meta device "
                         "(shapes only)")
    return rows


def check_first_order(what: str) -> None:
    """In the backward of an op whose gradients cross ranks: refuse create_graph=True.

    Grad mode is on inside a backward only when the caller asked for a graph
    of it (``create_graph=True``: double backward, gradient penalties,
    Hessian-vector products). The tensors a sequence-parallel backward
    receives from other ranks carry no autograd graph, so a second
    derivative would silently miss every term that crossed ranks (2 ranks,
    ring, fp64: off by 10^3). Every rank calling backward the same way
    raises here, before its first collective; none waits.
    """
    if torch.is_grad_enabled():
        raise ValueError(
            f"{what} has first-order gradients only: backward with create_graph=True (double "
            f"backward) would lose the terms exchanged between ranks. Double backward is "
            f"supported on one device (group=None or a group of one rank): dilated_attention "
            f"and ring_attention, any backend (the recorded backward runs the blockwise kernel)"
        )


# --------------------------------------------------------------------------
# Checks once per call signature.
#
# A model calls an op with a handful of signatures (the same arguments, and tensors of the
# same shapes, every layer and step), and at short lengths on a GPU the checks above were
# a fifth of the host's time before a call's first kernel could start (BENCHMARKS.md, "Host
# time per call"). So the ops run their static checks (those that read only the arguments'
# values and the tensors' types, shapes, dtypes, devices and requires_grad) once per
# signature and keep the checked configuration; what reads data or per-call state (a
# mask's any(), non-finite inputs, torch.func transforms, a dropout seed) runs every call.
# Only a configuration that passed is kept: a bad call raises every time.

# Scalars keyed by type and value (True, 1 and 1.0 are equal keys otherwise, but a check
# may take one and refuse another).
_PLAIN = frozenset((bool, int, float, str, type(None)))


def signature(tensors: Sequence[Optional[Tensor]], values: Sequence[Any]) -> Optional[Tuple]:
    """A hashable key of everything a call's static checks read, or None (check in full).

    `tensors` by type, shape, dtype, device, requires_grad and layout; `values` (the other
    arguments) by type and value: plain bools, ints, floats, strings, None, and lists or
    tuples of ints; with the grad mode and, for CPU tensors, TRITON_INTERPRET (which the
    Triton backend's check reads). None for any other argument (tensor subclasses such as
    parameters, DTensor or fake tensors included) and nested tensors, and while
    torch.compile traces (the checks are traced with the call there). Which packages are
    installed, and a device's compute capability, are taken as fixed for the process."""
    if torch.compiler.is_compiling():
        return None
    keys: list = []
    for x in tensors:
        if x is None:
            keys.append(None)
        elif type(x) is Tensor and not x.is_nested:  # a nested tensor has no shape
            keys.append((x.shape, x.dtype, x.device, x.requires_grad, x.layout))
        else:
            return None
    for value in values:
        kind = type(value)
        if kind in _PLAIN:
            keys.append((kind, value))
        elif (kind is list or kind is tuple) and all(type(item) is int for item in value):
            keys.append((kind, tuple(value)))
        else:
            return None
    device = keys[0][2] if keys[0] is not None else None
    interpret = os.environ.get("TRITON_INTERPRET") if getattr(device, "type", None) == "cpu" \
        else None
    return tuple(keys), torch.is_grad_enabled(), interpret


class CheckedCalls:
    """Checked configurations by call signature (``signature``): ``get(key, check)`` returns
    ``check()``'s mapping (read-only), running it only the first time `key` is seen (every
    time for a None key). Bounded: past `size` signatures it starts again empty."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._checked: Dict[Hashable, Mapping[str, Any]] = {}

    def get(self, key: Optional[Hashable], check: Callable[[], Dict[str, Any]]
            ) -> Mapping[str, Any]:
        found = self._checked.get(key) if key is not None else None
        if found is None:
            found = types.MappingProxyType(check())
            if key is not None:
                if len(self._checked) >= self._size:
                    self._checked.clear()
                self._checked[key] = found
        return found
