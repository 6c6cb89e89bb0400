"""Training a sequence-parallel model with DDP, FSDP2 or all_reduce_gradients: the gradients
and losses of one process, on real spawned gloo ranks (Note [gradients across ranks]).

Every combination trains the same float64 model from the same initial parameters on the
same batches and must reproduce one process that trains on the whole batch: the full
gradients after the first step (within 1e-10) and the loss over a few AdamW steps.
Combinations that cannot be right must raise on every rank (issue 15: DDP over the
sequence group used to halve every gradient, silently).
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import re
import sys
from typing import Dict, List, Optional

import pytest
import torch

from dilated_attention import LongNet, LongNetConfig, LongNetLM, all_reduce_gradients
from dilated_attention.distributed import comm
from dilated_attention.tools import launch
from dilated_attention.distributed.sharding import shard_sequence
from dilated_attention.models import IGNORE_INDEX
from dist_harness import run_distributed

CONFIG = dict(vocab_size=23, embed_dim=24, num_heads=6, ffn_dim=32, num_layers=2,
              num_encoder_layers=1, segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 4))
BATCH, N, STEPS = 4, 18, 3
TOL = dict(rtol=1e-10, atol=1e-10)


def _batch(step: int, kind: str):
    """The whole batch of one step: (tokens, targets[, source]) with as many targets per row
    (so the data-parallel replicas' token means average to the whole batch's)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, N), generator=g)
    targets = torch.randint(0, CONFIG["vocab_size"], (BATCH, N), generator=g)
    targets[:, ::5] = IGNORE_INDEX
    source = torch.randint(0, CONFIG["vocab_size"], (BATCH, N + 3), generator=g)
    return (source, tokens, targets) if kind == "encdec" else (tokens, targets)


def _build(kind: str, sp, *, shard_on=None, **overrides):
    """The model, the same on every rank; with `shard_on`, as a large one is built: on the
    meta device, then fully_shard on that mesh, to_empty and reset_parameters."""
    torch.manual_seed(0)  # the same initial parameters on every rank and in the reference
    cls = LongNet if kind == "encdec" else LongNetLM
    model = cls(LongNetConfig(**{**CONFIG, **overrides}), dtype=torch.float64, process_group=sp,
                device=None if shard_on is None else "meta")
    if shard_on is not None:
        _shard(model, shard_on)
        model.to_empty(device="cpu")
        model.reset_parameters()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from 1 and 0
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one tensor: FSDP2's DTensor shards gathered (a collective)."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.detach().clone()


def _train(kind: str, model, wrapped, *, sp=None, dp=None, reduce=None, steps: int = STEPS):
    """`steps` AdamW steps of `wrapped` (model, or its DDP wrapper) on this rank's rows.

    Data-parallel replica d of D takes batch rows [d B / D, (d + 1) B / D); sequence
    rank s its piece of each. `reduce`: the group all_reduce_gradients averages over after
    backward (None: the wrapper reduces). Returns the global losses (averaged over dp) and
    the first step's full gradients by parameter name.
    """
    replicas, replica = comm.group_size(dp), comm.group_rank(dp)
    rows = slice(replica * BATCH // replicas, (replica + 1) * BATCH // replicas)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: List[float] = []
    grads: Dict[str, torch.Tensor] = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        pieces = [shard_sequence(x[rows], sp) for x in _batch(step, kind)]
        _, loss = wrapped(*pieces)
        loss.backward()
        all_reduce_gradients(model, reduce)
        if step == 0:
            grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        opt.step()
        losses.append(float(comm.all_reduce_(loss.detach().clone(), dp, op="avg")))
    return {"losses": losses, "grads": grads}


@functools.lru_cache(maxsize=None)
def _reference(kind: str):
    model = _build(kind, None)
    return _train(kind, model, model)


def _ddp(model, group):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group)


def _shard(model, mesh) -> None:
    """FSDP2 as it wants to be applied: each block, then the model."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _raises(fn) -> Optional[str]:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------
# One spawn of 4 ranks for every case (importing DDP loads torch._dynamo: seconds a rank).
# Sequence parallelism alone runs on the first P ranks; then data x sequence on a 2 x 2 mesh
# (rank r at (r // 2, r % 2)), each data-parallel replica with its own batch rows.

SEQUENCE_WORLDS = (2, 3)


def _sequence_cases(group):
    out = {}
    for kind in ("lm", "encdec"):
        model = _build(kind, group)
        out[(kind, "all_reduce_gradients")] = _train(kind, model, model, sp=group, reduce=group)
        model = _build(kind, group)
        out[(kind, "ddp")] = _train(kind, model, _ddp(model, group), sp=group)
    # no gradient reduction at all: the next training forward raises on every rank
    model = _build("lm", group)
    _train("lm", model, model, sp=group, steps=1)
    out["unreduced"] = _raises(lambda: _train("lm", model, model, sp=group, steps=1))
    # the same with two micro-batches per step: the first forward after the step raises
    model = _build("lm", group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def accumulate(step):
        for micro in range(2):
            pieces = [shard_sequence(x, group) for x in _batch(2 * step + micro, "lm")]
            model(*pieces)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    accumulate(0)
    out["unreduced, accumulated"] = _raises(lambda: accumulate(1))
    # a hand-written step through .data (no version counter moves): the second forward
    model = _build("lm", group)

    def by_hand(step):
        model(*[shard_sequence(x, group) for x in _batch(step, "lm")])[1].backward()
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-1e-2)
                p.grad = None

    by_hand(0)
    out["unreduced, updated through .data"] = _raises(lambda: by_hand(1))
    return out


def _mesh_cases(group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_sp",))  # the mesh flattened
    sp, dp = mesh["sp"].get_group(), mesh["dp"].get_group()
    run = functools.partial(_train, "lm", sp=sp, dp=dp)
    out = {}
    model = _build("lm", sp)
    out["ddp over dp x sp"] = run(model, _ddp(model, group))
    model = _build("lm", sp)
    out["all_reduce_gradients over dp x sp"] = run(model, model, reduce=group)
    model = _build("lm", sp)
    _shard(model, mesh["dp"])
    out["fully_shard on dp, all_reduce_gradients over sp"] = run(model, model, reduce=sp)
    model = _build("lm", sp, checkpoint="layers")  # FSDP2 unshards again in the recomputation
    _shard(model, mesh["dp"])
    out["fully_shard on dp, checkpointed blocks"] = run(model, model, reduce=sp)
    model = _build("lm", sp)
    _shard(model, flat)
    out["fully_shard on dp x sp flattened"] = run(model, model)
    # the meshes themselves as the groups: the model's (1-D) and the reduction's (2-D)
    model = _build("lm", mesh["sp"])
    _shard(model, mesh["dp"])
    out["a mesh as the model's group, fully_shard on dp"] = run(model, model, reduce=mesh["sp"])
    model = _build("lm", sp)
    out["all_reduce_gradients over the 2-D mesh"] = run(model, model, reduce=mesh)
    model = _build("lm", sp, shard_on=mesh["dp"])
    initial = {name: _full(p) for name, p in model.named_parameters()}
    out["built on meta, fully_shard on dp"] = {"initial": initial,
                                               **run(model, model, reduce=sp)}
    # what cannot be right raises on every rank
    model = _build("lm", sp)
    wrapped = _ddp(model, dp)  # DDP over the data-parallel ranks alone
    run(model, wrapped, steps=1)
    out["ddp over dp alone"] = _raises(lambda: run(model, wrapped, steps=1))
    model = _build("lm", sp)
    _shard(model, mesh["dp"])  # fully_shard on dp, the sequence reduction forgotten
    run(model, model, steps=1)
    out["fully_shard on dp alone"] = _raises(lambda: run(model, model, steps=1))
    model = _build("lm", sp)
    _shard(model, flat)  # gradients already averaged over dp x sp, and sharded over sp
    out["fully_shard flattened + all_reduce_gradients"] = _raises(
        lambda: run(model, model, reduce=sp, steps=1))
    return out


def _example():
    """examples/train_long_context.py as a module (its folder on sys.path, as for a script)."""
    folder = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("train_long_context")


EXAMPLE_ARGS = ["--seq-len", "64", "--key-len", "4", "--batch-size", "4", "--steps", "3",
                "--dtype", "float64", "--eval-batches", "1"]


def _rank_main(group):
    out = {}
    for world in SEQUENCE_WORLDS:
        sub = launch.new_group(range(world))  # every rank calls; None outside
        out[world] = _sequence_cases(sub) if sub is not None else None
    out["mesh"] = _mesh_cases(group)
    # examples/train_long_context.py --mesh 2x2: what its spawned ranks run
    example = _example()
    out["example"] = example._train_rank(group, example.parse_args(EXAMPLE_ARGS + ["--mesh",
                                                                                 "2x2"]))
    return out


@functools.lru_cache(maxsize=None)
def _spawn():
    return run_distributed(_rank_main, 4, timeout=300)


def _assert_equal(got, want, rank) -> None:
    for name, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, **TOL,
                                   msg=lambda m: f"rank {rank} {name}: {m}")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("world", SEQUENCE_WORLDS)
@pytest.mark.parametrize("kind", ["lm", "encdec"])
@pytest.mark.parametrize("how", ["all_reduce_gradients", "ddp"])
def test_sequence_parallel_gradients_equal_one_process(world, kind, how):
    want = _reference(kind)
    for rank, result in enumerate(_spawn()[:world]):
        _assert_equal(result[world][(kind, how)], want, rank)


@pytest.mark.distributed
@pytest.mark.parametrize("world", SEQUENCE_WORLDS)
def test_unreduced_gradients_raise_at_the_next_step(world):
    for result in _spawn()[:world]:
        for case in ("unreduced", "unreduced, accumulated", "unreduced, updated through .data"):
            msg = result[world][case]
            assert msg is not None and "parameters differ between the ranks of process_group" \
                in msg, case
            assert "all_reduce_gradients" in msg


MESH_WAYS = ("ddp over dp x sp", "all_reduce_gradients over dp x sp",
             "fully_shard on dp, all_reduce_gradients over sp", "fully_shard on dp x sp flattened",
             "fully_shard on dp, checkpointed blocks",
             "a mesh as the model's group, fully_shard on dp",
             "all_reduce_gradients over the 2-D mesh")


@pytest.mark.distributed
@pytest.mark.parametrize("how", MESH_WAYS)
def test_data_x_sequence_gradients_equal_one_process(how):
    want = _reference("lm")
    for rank, result in enumerate(_spawn()):
        _assert_equal(result["mesh"][how], want, rank)


@pytest.mark.distributed
def test_a_model_built_on_meta_trains_as_one_process():
    """LongNetLM built on the meta device, sharded with FSDP2, then to_empty and
    reset_parameters: the same parameters on every rank, and it trains as one process that
    starts from them (DTensor draws each shard, so not the single-process draws)."""
    results = [result["mesh"]["built on meta, fully_shard on dp"] for result in _spawn()]
    initial = results[0]["initial"]
    for result in results[1:]:
        for name, p in result["initial"].items():
            torch.testing.assert_close(p, initial[name], rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in initial.values())
    model = _build("lm", None)
    model.load_state_dict(initial)
    want = _train("lm", model, model)
    for rank, result in enumerate(results):
        _assert_equal(result, want, rank)


@pytest.mark.distributed
def test_data_x_sequence_mistakes_raise_on_every_rank():
    for result in _spawn():
        mesh = result["mesh"]
        for how in ("ddp over dp alone", "fully_shard on dp alone"):
            assert mesh[how] is not None, how
            assert "parameters differ between the ranks of process_group" in mesh[how], how
        msg = mesh["fully_shard flattened + all_reduce_gradients"]
        assert msg is not None and "sharded (FSDP2) over ranks of `group`" in msg


def test_example_help_shows_every_default(capsys):
    """examples/train_long_context.py --help (and finetune_hf.py, which shares its
    arguments) states each option's default."""
    with pytest.raises(SystemExit):
        _example().parse_args(["--help"])
    options = capsys.readouterr().out.split("options:")[1]
    # one entry per option: its name line and the indented help lines below it
    entries = re.split(r"\n  (?=--)", options)[1:]
    assert len(entries) > 10
    for entry in entries:
        assert "(default: " in " ".join(entry.split()), entry


@pytest.mark.distributed
def test_example_mesh_2x2_equals_one_process():
    """examples/train_long_context.py --mesh 2x2 (FSDP2 over dp, sequence over sp) trains
    like one process on the whole batch: losses and recall accuracy."""
    example = _example()
    single = example.train(example.parse_args(EXAMPLE_ARGS))
    for result in _spawn():
        got = result["example"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(single["losses"]),
                                   rtol=0, atol=1e-12)
        assert got["accuracy"] == single["accuracy"]
