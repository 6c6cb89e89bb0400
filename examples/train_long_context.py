"""Train a tiny LongNetLM on a task that needs far context, on CPU.

The task (recall over a long sequence): each sequence starts with a key (one
of --keys ids) written as a run of --key-len tokens, continues with random
filler ids and ends with a QUERY id, where the model must predict the key.
Only the query has a target, so chance accuracy is 1 / keys. The key lies
about seq_len tokens back: the local patterns (segments of 128 and 512) never
see it, only the sparsest pattern (segment 2048, rate 4) does, one in four
positions per head; the run of --key-len >= 4 copies puts some of it in view
of every head. Beating chance therefore means the dilated attention carried
information across the whole sequence.

    python examples/train_long_context.py                 # one process
    python examples/train_long_context.py --world-size 2  # sequence split over 2 gloo ranks
    python examples/train_long_context.py --world-size 2 --compare  # and diff against 1 process
    python examples/train_long_context.py --mesh 2x2 --compare  # data x sequence on 4 ranks
    python examples/train_long_context.py --packed 4 --check-unpacked  # 4 documents a sequence
    python examples/train_long_context.py --seq-len 65536 --batch-size 1 --checkpoint layers --steps 2

The last line shows memory, not learning: the longest segment is 2048, so at
65,536 tokens no pattern reaches the key and the task cannot be learned.

With --world-size P every rank holds a contiguous piece of every sequence;
only the dilated attention communicates, the loss is the token-weighted mean
over the whole sequence and gradients are all-reduced, so the loss curve is
the single-process one up to floating-point rounding: in float32 the losses
first agree closely and then drift apart as training amplifies rounding
differences (how closely depends on the machine and its threads; BENCHMARKS.md,
"Training examples", measured 4.8e-7 over the first 10 steps of
--world-size 2 --compare and up to 0.13 over 200, largest around the loss's
sharp drop); with --dtype float64 they agreed to 1e-14 over 120 steps.

With --mesh DPxSP the DP * SP ranks form a device mesh ("dp", "sp"): the
model is sequence-parallel over mesh["sp"] (its process_group) and
fully_shard (FSDP2) shards it over mesh["dp"], each block and then the
model; data-parallel replica d trains on its own rows of every batch
(--batch-size / DP of them). FSDP2 averages the gradients over "dp" and
all_reduce_gradients averages them over "sp" (Note [gradients across ranks]
in dilated_attention/distributed/gradients.py); the reported loss is the
replicas' mean, which is the whole batch's (every row has as many targets),
so --compare again checks against one process training on the whole batch.

--checkpoint none|layers|offload is LongNetConfig's checkpoint mode (what
each block keeps for backward; Note [checkpoint modes] in
dilated_attention/models/checkpointing.py); the loss never holds the
logits. Every run reports each rank's peak memory during training: the
growth of its resident memory (VmHWM) over the process before the first
step, which includes AdamW's state and the gradients.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from dilated_attention import LongNetConfig, LongNetLM, all_reduce_gradients, shard_sequence
from dilated_attention.distributed import comm
from dilated_attention.models import IGNORE_INDEX
from dilated_attention.models.checkpointing import CHECKPOINT_MODES
from dilated_attention.tools import launch
from dilated_attention.tools.bench import PeakMemory
from dilated_attention.tools.cli import Progress
from dilated_attention.tools.settings import default_threads


def parse_args(argv: Optional[List[str]] = None,
               description: Optional[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--keys", type=int, default=8, help="distinct keys (chance = 1/keys)")
    p.add_argument("--key-len", type=int, default=32,
                   help="the key is written as a run of this many tokens at the start")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and data")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="batches of the recall accuracy after training")
    p.add_argument("--world-size", type=int, default=1,
                   help="gloo ranks to split the sequence over")
    p.add_argument("--mesh", type=_mesh_shape, default=None, metavar="DPxSP",
                   help="DP * SP ranks: FSDP2 over DP data-parallel replicas, each sequence "
                        "split over SP ranks (e.g. 2x2)")
    p.add_argument("--compare", action="store_true",
                   help="with --world-size > 1 or --mesh: also train on one process, compare "
                        "the losses")
    p.add_argument("--packed", type=int, default=0, metavar="K",
                   help="pack K documents of random lengths into each sequence (each its own "
                        "recall task; attention stays inside each document)")
    p.add_argument("--check-unpacked", action="store_true",
                   help="with --packed: also train on the same documents one at a time and "
                        "compare the losses")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="parameter and activation dtype")
    p.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="none",
                   help="what each block keeps for backward: everything, only its input "
                        "(recomputing the block), or its input in host memory")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per process (0: cores / world size)")
    args = p.parse_args(argv)
    if not 2 <= args.keys <= VOCAB - 2:
        p.error(f"--keys must be in [2, {VOCAB - 2}], got {args.keys}")
    if not 1 <= args.key_len < args.seq_len:
        p.error(f"--key-len must be in [1, seq-len), got {args.key_len}")
    if args.steps < 1 or args.batch_size < 1 or args.eval_batches < 1:
        p.error("--steps, --batch-size and --eval-batches must be positive")
    if args.mesh is not None:
        dp, sp = args.mesh
        if args.world_size not in (1, dp * sp):
            p.error(f"--world-size {args.world_size} and --mesh {dp}x{sp} disagree: the mesh "
                    f"has {dp * sp} ranks (leave out --world-size)")
        if args.batch_size % dp:
            p.error(f"--batch-size {args.batch_size} must divide over the {dp} data-parallel "
                    f"replicas of --mesh {dp}x{sp}")
        if sp > args.seq_len:
            p.error(f"--mesh {dp}x{sp}: {sp} sequence ranks exceed --seq-len {args.seq_len}")
        args.world_size = dp * sp
    if args.world_size < 1 or args.world_size > args.seq_len:
        p.error(f"--world-size must be in [1, seq_len], got {args.world_size}")
    if args.packed < 0 or args.packed * (args.key_len + 2) > args.seq_len:
        p.error(f"--packed {args.packed} documents of at least key-len + 2 tokens do not fit "
                f"in --seq-len {args.seq_len}")
    if args.check_unpacked and (not args.packed or args.world_size > 1):
        p.error("--check-unpacked needs --packed and one process")
    return args


VOCAB = 64
QUERY = VOCAB - 1


def _mesh_shape(text: str) -> Tuple[int, int]:
    """"DPxSP" (e.g. "2x2") -> (DP, SP), both positive."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected DPxSP with positive integers, e.g. 2x2; "
                                         f"got {text!r}")
    return int(parts[0]), int(parts[1])


def model_config(args: argparse.Namespace) -> LongNetConfig:
    # the tiny preset: 2 layers, width 64, 4 heads; segments 128, 512, 2048 with rates
    # 1, 2, 4 (every rate <= heads, so every position takes part in every pattern)
    return LongNetConfig.from_name("tiny", vocab_size=VOCAB, checkpoint=args.checkpoint)


def make_batch(args: argparse.Namespace, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The full (b, n) tokens and targets of one step, the same on every rank."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    b, n = args.batch_size, args.seq_len
    keys = torch.randint(0, args.keys, (b,), generator=g)
    tokens = torch.randint(args.keys, QUERY, (b, n), generator=g)
    tokens[:, : args.key_len] = keys[:, None]
    tokens[:, -1] = QUERY
    targets = torch.full((b, n), IGNORE_INDEX)
    targets[:, -1] = keys
    return tokens, targets


def make_packed_batch(args: argparse.Namespace, step: int):
    """(b, n) tokens, targets and the documents' cu_seqlens (None unless --packed).

    Each document is one recall task: its key at its start, its query at its end.
    """
    if not args.packed:
        return make_batch(args, step) + (None,)
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    b, n = args.batch_size, args.seq_len
    count = args.packed
    shortest = args.key_len + 2
    # document lengths: the shortest each, the rest of the sequence spread at random
    cuts = sorted(torch.randint(0, n - count * shortest + 1, (count - 1,), generator=g).tolist())
    extra = [hi - lo for lo, hi in zip([0] + cuts, cuts + [n - count * shortest])]
    cu = [0]
    for e in extra:
        cu.append(cu[-1] + shortest + e)
    tokens = torch.randint(args.keys, QUERY, (b, n), generator=g)
    targets = torch.full((b, n), IGNORE_INDEX)
    for s, e in zip(cu[:-1], cu[1:]):
        keys = torch.randint(0, args.keys, (b,), generator=g)
        tokens[:, s : s + args.key_len] = keys[:, None]
        tokens[:, e - 1] = QUERY
        targets[:, e - 1] = keys
    return tokens, targets, cu


def my_rows(x: torch.Tensor, group, dp=None) -> torch.Tensor:
    """This rank's part of a whole (b, n) batch: its data-parallel replica's rows (`dp`, the
    data-parallel group or None), and of those its piece of the sequence (`group`)."""
    return shard_sequence(shard_sequence(x, dp, dim=0), group)


def evaluate(model: LongNetLM, args: argparse.Namespace, group, dp=None) -> float:
    """Recall accuracy at the query positions on held-out batches."""

    def predict(batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
        tokens, targets, cu = make_packed_batch(args, batch)
        logits, _ = model(my_rows(tokens, group, dp), cu_seqlens=cu)
        return logits, my_rows(targets, group, dp)

    return accuracy(model, args, group, predict, dp)


def accuracy(model: torch.nn.Module, args: argparse.Namespace, group,
             predict: Callable[[int], Tuple[torch.Tensor, torch.Tensor]], dp=None) -> float:
    """The share of targets (over all ranks of `group` and `dp`) that ``predict(batch)``'s
    logits get right, over args.eval_batches held-out batches (negative batch numbers: never
    trained on)."""
    correct = total = 0
    model.eval()
    with torch.no_grad():
        for i in range(args.eval_batches):
            logits, targets = predict(-1 - i)
            asked = targets != IGNORE_INDEX  # the query positions this rank holds
            correct += int((logits.argmax(-1)[asked] == targets[asked]).sum())
            total += int(asked.sum())
    model.train()
    counts = torch.tensor([correct, total], dtype=torch.float64)
    comm.all_reduce_(comm.all_reduce_(counts, group), dp)
    return float(counts[0] / counts[1])


def _one_by_one(model: LongNetLM, tokens, targets, cu) -> torch.Tensor:
    """The packed batch's loss, computed document by document: the token-weighted mean of
    each document's own loss (positions restart at each document, as packing restarts them)."""
    total, count = 0.0, 0
    for s, e in zip(cu[:-1], cu[1:]):
        _, loss = model(tokens[:, s:e], targets[:, s:e])
        c = int((targets[:, s:e] != IGNORE_INDEX).sum())
        total, count = total + loss * c, count + c
    return total / max(count, 1)


def train(args: argparse.Namespace, group=None, unpacked: bool = False,
          mesh=None) -> Dict[str, object]:
    """Train on this process's piece of every sequence; returns the loss curve and accuracy.

    unpacked (with --packed): run each document of a sequence on its own instead.
    mesh: a ("dp", "sp") device mesh whose "sp" group is `group`: FSDP2 over "dp", each
    data-parallel replica training on its own rows of every batch.
    """
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    dtype = getattr(torch, args.dtype)
    model = LongNetLM(model_config(args), dtype=dtype, process_group=group)
    dp = None
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        dp = mesh["dp"].get_group()
        for block in model.layers:  # each block its own FSDP2 unit, then the rest
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])

    def batch_loss(step: int) -> torch.Tensor:
        tokens, targets, cu = make_packed_batch(args, step)
        if unpacked:
            return _one_by_one(model, tokens, targets, cu)
        _, loss = model(my_rows(tokens, group, dp), my_rows(targets, group, dp), cu_seqlens=cu)
        return loss

    result = fit(model, args, group, batch_loss, dp)
    return {**result, "accuracy": evaluate(model, args, group, dp)}


def fit(model: torch.nn.Module, args: argparse.Namespace, group,
        batch_loss: Callable[[int], torch.Tensor], dp=None) -> Dict[str, object]:
    """AdamW over args.steps steps of ``batch_loss(step)`` (this rank's part of the global
    loss); gradients averaged over the sequence-parallel `group` (after FSDP2 averaged them
    over the data-parallel `dp`, if any). Returns the loss curve (the mean of the replicas'
    losses), the seconds taken and this process's peak memory growth while training."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 10)

    def lr_factor(step: int) -> float:  # linear warm-up, cosine decay
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    # rank 0 reports; tqdm in a spawned rank leaks its multiprocessing lock at exit, so
    # spawned ranks print a plain line every 10 steps instead
    bar = (Progress(args.steps, "train", use_tqdm=group is None and dp is None, every=10)
           if comm.group_rank(group) == 0 and comm.group_rank(dp) == 0 else None)
    losses: List[float] = []
    memory = PeakMemory("cpu")
    memory.start()
    start = time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = batch_loss(step)
        loss.backward()
        # each rank's gradients are SP times its own tokens' part: the average over the
        # sequence ranks is the whole gradient (Note [gradients across ranks])
        all_reduce_gradients(model, group)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(comm.all_reduce_(loss.detach().clone(), dp, op="avg").item())
        if bar is not None:
            bar.step(f"loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return {"losses": losses, "seconds": seconds, "peak_bytes": [memory.peak_bytes()]}


def _train_rank(group, args: argparse.Namespace) -> Dict[str, object]:
    if args.mesh is None:
        return train(args, group)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", args.mesh, mesh_dim_names=("dp", "sp"))
    return train(args, mesh["sp"].get_group(), mesh=mesh)


def train_distributed(args: argparse.Namespace,
                      train_rank: Callable = _train_rank) -> Dict[str, object]:
    """Spawn args.world_size gloo ranks on this machine, each running ``train_rank(group,
    args)`` (importable by name); returns rank 0's result."""
    threads = args.threads or default_threads(args.world_size)
    results = launch.spawn(
        train_rank, args.world_size, (args,), timeout=3600.0, pg_timeout=300.0, threads=threads
    )
    return {**results[0], "peak_bytes": [r["peak_bytes"][0] for r in results]}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    chance = 1.0 / args.keys
    if args.packed:
        print(f"task: {args.packed} documents per sequence, each recalls the key written at its "
              f"start ({args.key_len} tokens) at its last position; chance {chance:.3f}")
    else:
        print(f"task: recall the key at positions 0..{args.key_len - 1} at position "
              f"{args.seq_len - 1}; chance {chance:.3f}")
    if args.world_size == 1:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        result = train(args)
    else:
        result = train_distributed(args)
    layout = (f"mesh {args.mesh[0]}x{args.mesh[1]} (FSDP2 over dp, sequence over sp), "
              if args.mesh else "")
    report(f"{layout}{args.world_size} process(es)" + (f", {args.packed} documents per "
                                                       f"sequence" if args.packed else ""),
           result, chance)
    if args.check_unpacked:
        unpacked = train(args, unpacked=True)
        report("the same documents one by one", unpacked, chance)
        diffs = [abs(a - b) for a, b in zip(result["losses"], unpacked["losses"])]
        print(f"max |loss difference|, packed vs one by one, over {args.steps} steps: "
              f"{max(diffs):.3e} ({args.dtype})")
    if args.compare and args.world_size > 1:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        compare(result, train(args), args, chance)
    return 0


def compare(result: Dict[str, object], single: Dict[str, object], args: argparse.Namespace,
            chance: float) -> None:
    """Print the one-process run and its loss curve next to the sequence-parallel one."""
    report("1 process", single, chance)
    diffs = [abs(a - b) for a, b in zip(result["losses"], single["losses"])]
    print("step  loss(1 process)  loss(%d ranks)  |diff|" % args.world_size)
    for i in range(0, args.steps, max(1, args.steps // 10)):
        print(f"{i:4d}  {single['losses'][i]:.10f}  {result['losses'][i]:.10f}  {diffs[i]:.2e}")
    early = min(10, args.steps)
    hint = "" if args.dtype == "float64" else (
        "; training amplifies rounding differences step by step, use --dtype float64 "
        "for a tight check")
    print(f"max |loss difference|: first {early} steps {max(diffs[:early]):.3e}, "
          f"all {args.steps} steps {max(diffs):.3e} ({args.dtype}{hint})")


def report(what: str, result: Dict[str, object], chance: float) -> None:
    losses = result["losses"]
    print(
        f"{what}: {len(losses)} steps in {result['seconds']:.1f} s; loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f}; recall accuracy {result['accuracy']:.3f} (chance {chance:.3f}); "
        f"peak memory per rank {_mebibytes(result['peak_bytes'])}"
    )


def _mebibytes(peaks: List[Optional[int]]) -> str:
    """Each rank's peak growth in MiB ("n/a" where this system cannot tell)."""
    return ", ".join("n/a" if p is None else f"{p / 2**20:.0f} MiB" for p in peaks)


if __name__ == "__main__":
    sys.exit(main())
