"""triton_launch: the fused kernels launched from a kept compiled kernel pass Triton's
launcher what JITFunction.run would, each tensor as its address where no launch hook is set.

Without a GPU the kernels compile for sm_90 under benchmarks/bench_call_overhead.py's
stand-in driver (its --launcher mode's), whose loader gives each compiled binary its own
function handle and whose launcher here records its arguments, in a process of its own
(the tests' conftest sets TRITON_INTERPRET, which would make interpreted kernels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from dilated_attention import triton_launch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Runs the op's forward and backward on CPU tensors through the compiled kernels, first
# through triton_launch ("kept"), then with every launch through JITFunction.run ("jit"),
# and prints per mode each launch as the launcher received it.
SCRIPT = r"""
import json, os, sys
import torch
from triton.runtime import driver
import triton.runtime.jit as jit

sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
from bench_call_overhead import StandInDriver

launches = []
hooked = []  # what the launch hooks saw: ("enter" or "exit", the kernel's name)
# address -> the tensor a kept launch passed as that address (triton_launch._call_key's)
pointed = {}
addressed = [0]  # parameters a launch passed as a tensor's address


def launched(name, args):
    # as Triton's C launcher: the enter hook, the launch, the exit hook (a None is skipped)
    metadata, enter, leave = args[6:9]
    if enter is not None:
        enter(metadata)
    launches[-1].append(describe(name, args))
    if leave is not None:
        leave(metadata)


driver.set_active(StandInDriver(launched))
from dilated_attention import backends, dilated_attention, fused, triton_kernels, triton_launch
assert type(triton_kernels.fused_forward).__name__ == "JITFunction"
# the interpreter never runs here (the kernels stay compiled), so its release rule (triton
# 3.6 beside numpy 2.5 on the GPU machines) does not apply
backends._INTERPRETER_PROBLEM = None
os.environ["TRITON_INTERPRET"] = "1"  # the op's check for CPU tensors; kernels stay compiled
fused._kernels = lambda device: triton_kernels
fused.tile_sizes = lambda device, dtype, head_dim, dropout=False: fused.cuda_tile_sizes(
    (9, 0), dtype, 64, dropout)
binds = [0]
run = jit.JITFunction.run

def counted(self, *args, **kwargs):
    binds[0] += 1
    return run(self, *args, **kwargs)

jit.JITFunction.run = counted

def tensor(x):
    return ["tensor", str(x.dtype), list(x.shape), list(x.stride()), x.data_ptr() % 16]

def param(x):
    # a kept launch passes its tensors as their addresses: each stands for its tensor
    if isinstance(x, torch.Tensor):
        return tensor(x)
    if type(x) is int and x in pointed:
        addressed[0] += 1
        return tensor(pointed[x])
    return x

def describe(name, args):
    grid, stream, function, metadata = args[:3], args[3], args[4], args[5]
    return [name, list(grid), stream, str(function), repr(metadata), [param(x) for x in args[9:]]]

addresses_of = triton_launch._addresses

def recording_addresses(tensors):
    # kept across a mode's calls: a recipe's own addresses (its plan's tables) were taken in
    # the call that recorded it; the tensors held here keep each address to one tensor
    found = addresses_of(tensors)
    pointed.update(zip(found, tensors))
    return found

triton_launch._addresses = recording_addresses
replayed = [0]
replay = triton_launch.RECIPES.replay

def counted_replay(key, tensors):
    done = replay(key, tensors)
    replayed[0] += done
    return done

triton_launch.RECIPES.replay = counted_replay

def inputs(dtype, misaligned):
    # (b, n, h, d); misaligned: q starts 1 element past a 16-byte boundary
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64 * 4 * 64 + 1, generator=g).to(dtype)
    q = (base[1:] if misaligned else base[:-1]).view(1, 64, 4, 64)
    k, v, dout = (torch.randn(1, 64, 2, 64, generator=g).to(dtype) for _ in range(3))
    return q, k, v, dout[:, :, :1].expand(1, 64, 4, 64).contiguous()

def step(dtype, misaligned):
    q, k, v, dout = inputs(dtype, misaligned)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    dilated_attention(*leaves, [16, 32], [1, 2], backend="triton").backward(dout)

calls = [(torch.float16, False), (torch.float16, False), (torch.float16, True),
         (torch.float16, False), (torch.float32, False), (torch.float16, True),
         (torch.float16, True)]
from triton import knobs

def enter_hook(metadata):
    hooked.append(("enter", metadata.get()["name"]))

def exit_hook(metadata):
    hooked.append(("exit", metadata.get()["name"]))

result = {}
kept_launcher = triton_launch.launcher
for mode in ("kept", "jit", "kept hooked", "jit hooked"):
    triton_launch.launcher = kept_launcher if mode.startswith("kept") else (lambda kernel: kernel)
    if mode.endswith("hooked"):
        knobs.runtime.launch_enter_hook.add(enter_hook)
        knobs.runtime.launch_exit_hook.add(exit_hook)
    triton_launch.forget()
    launches.clear()
    hooked.clear()
    pointed.clear()
    binds[0] = addressed[0] = replayed[0] = 0
    for dtype, misaligned in calls:
        launches.append([])  # this call's launches
        step(dtype, misaligned)
    result[mode] = {"calls": list(launches), "binds": binds[0], "hooked": list(hooked),
                    "addressed": addressed[0], "replayed": replayed[0]}
    if mode.endswith("hooked"):
        knobs.runtime.launch_enter_hook.remove(enter_hook)
        knobs.runtime.launch_exit_hook.remove(exit_hook)

# what a recorder keeps: launches whose tensors are the call's, or live in what the recipe
# holds (a view of a plan's table); a launch that passed any other tensor keeps nothing
class Kept:
    _tensors = 2

    def _launch(self, grid, *args, **kwargs):
        return "compiled", args[2:]

recipes = triton_launch.Recipes()
table, own = torch.zeros(8, dtype=torch.int32), torch.zeros(4)
for name, kept, second in (("plan's view", (table,), table[2:]), ("stray", (table,), own + 1),
                           ("nothing held", (), table[2:])):
    recorder = recipes.recorder(name, (own,), kept=kept)
    recorder._record(Kept(), (1, 1, 1), own, second, 7)
    recorder.keep()
    result[name] = len(recipes._recipes)
print(json.dumps(result))
"""


def test_kept_kernels_launch_as_triton_would(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = env.get("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # every launch names its compile options (triton_launch.COMPILE_OPTIONS): triton 3.9
    # warns where FP fusion is left to its default, which 3.10 turns off
    assert "FP_FUSION" not in done.stderr, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    kept, jit = result["kept"], result["jit"]
    # the same kernels (function handles), grids, streams and parameters, launch for launch
    assert kept["calls"] == jit["calls"]
    launches = sum(len(call) for call in jit["calls"])
    assert jit["binds"] == launches
    # kept: each call key bound once (its first call), the repeated calls launched directly
    assert 0 < kept["binds"] <= launches - len(jit["calls"][1]) - len(jit["calls"][3]) \
        - len(jit["calls"][5]) - len(jit["calls"][6])
    # and a call recorded whole (the second of its kind, whose launches were all kept) is
    # launched again from its recipe: the forward and backward of calls 4 and 7
    assert kept["replayed"] == 4 and jit["replayed"] == 0
    # and the keys told the specialisations apart: q's alignment and the dtype each gave
    # the forward other compiled kernels (calls: fp16, fp16, fp16 with q misaligned, fp16,
    # fp32, fp16 with q misaligned)
    forward = [{launch[3] for launch in call if launch[0] == "fused_forward"}
               for call in jit["calls"]]
    assert forward[0] == forward[1] == forward[3]
    assert forward[2] == forward[5] == forward[6]
    assert forward[2] != forward[0] and forward[4] != forward[0]
    # launch hooks (a profiler's): each launch calls them as Triton's own path does, with
    # the launch metadata; without them the kept launches build none
    assert kept["hooked"] == jit["hooked"] == []
    # without hooks a kept launch passes its tensors as their addresses (so Triton's launcher
    # asks the driver about none), with hooks as the tensors (a hook may read them)
    assert kept["addressed"] > 0 and jit["addressed"] == 0
    assert result["kept hooked"]["addressed"] == result["jit hooked"]["addressed"] == 0
    hooked = result["jit hooked"]["hooked"]
    assert result["kept hooked"]["hooked"] == hooked
    assert len(hooked) == 2 * launches and {name for _, name in hooked} >= {"fused_forward"}
    assert result["kept hooked"]["calls"] == result["jit hooked"]["calls"] == jit["calls"]
    # a launch hook: no recipe launches (a hook may read the launch's tensors)
    assert result["kept hooked"]["replayed"] == 0
    # a recipe is kept only where every tensor is the call's or held by it
    assert (result["plan's view"], result["stray"], result["nothing held"]) == (1, 1, 1)


def test_call_keys_follow_what_triton_specialises() -> None:
    q = torch.zeros(2, 8, 16)
    misaligned = torch.zeros(2 * 8 * 16 + 1)[1:].view(2, 8, 16)
    kwargs = {"CAUSAL": True, "num_warps": 4}
    def key(*args):
        return triton_launch._call_key(*args)[0]

    first, addresses = triton_launch._call_key(0, 1, (q, 3, 0.5), kwargs)
    assert addresses == [q.data_ptr()]
    assert first == key(0, 1, (torch.ones(2, 8, 16), 3, 0.5), kwargs)
    assert first != key(0, 1, (misaligned, 3, 0.5), kwargs)
    assert first != key(0, 1, (q.half(), 3, 0.5), kwargs)
    assert first != key(0, 1, (q, 4, 0.5), kwargs)
    assert first != key(1, 1, (q, 3, 0.5), kwargs)
    assert first != key(0, 1, (q, 3, 0.5), {**kwargs, "num_warps": 8})
    # a number where a tensor was: no key, so Triton's own path
    assert triton_launch._call_key(0, 1, (3, 3, 0.5), kwargs) == (None, None)
    assert triton_launch._leading_tensors((q, q, 1, q)) == 2


def test_interpreted_kernels_and_stand_ins_launch_as_they_are() -> None:
    class StandIn:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    stand_in = StandIn()
    assert triton_launch.launcher(stand_in) is stand_in


# Triton specialises a pointer on 16-byte alignment: a tensor 8 bytes past a 16-byte boundary
# is a different kernel, so a different key.

def test_call_keys_tell_8_byte_from_16_byte_alignment():
    q = torch.zeros(2, 8, 16)
    shifted = torch.zeros(2 * 8 * 16 + 2)[2:].view(2, 8, 16)  # 8 bytes past q's alignment
    assert q.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 8
    kwargs = {"CAUSAL": True}
    assert triton_launch._call_key(0, 1, (q, 3), kwargs)[0] != \
        triton_launch._call_key(0, 1, (shifted, 3), kwargs)[0]


# A recorder finds each tensor a launch passes among the call's by identity (the first it
# is): a call whose q is its k and v (self-attention on one tensor) records k's and v's
# launches with q's slot. On a GPU a later call of the same shapes with three tensors
# replayed that recipe and launched q's address for k and v: a wrong result, silently.

def test_a_recipe_of_one_tensor_in_two_places_is_not_replayed_for_two(monkeypatch):
    from triton.runtime import driver

    class Device:  # what replay and keep ask the driver: device 0, stream 0
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    monkeypatch.setattr(driver, "_active", Device())
    launched = []

    class Compiled:
        function = packed_metadata = None

        def run(self, *args):
            # grid (3), stream, function, metadata, 3 hooks, then the tensors' addresses
            launched.append(args[9:])

    class Kept:  # a kept launch of two tensors
        _tensors = 2

        def _launch(self, grid, *args, **kwargs):
            return Compiled(), args[2:]

    recipes = triton_launch.Recipes()
    one = torch.zeros(4)
    recorder = recipes.recorder("call", (one, one), kept=())
    recorder._record(Kept(), (1, 1, 1), one, one, 7)
    recorder.keep()
    first, second = torch.zeros(4), torch.zeros(4)
    assert not recipes.replay("call", (first, second)) and launched == []
    # the same tensor in both places again: the recipe launches with its address
    assert recipes.replay("call", (first, first))
    assert launched == [(first.data_ptr(), first.data_ptr(), 7)]
