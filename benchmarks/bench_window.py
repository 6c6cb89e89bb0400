"""Sliding-window attention: the op against its kernel floor, its memory, its halo traffic.

    python benchmarks/bench_window.py                                  # 64K, window 4096 causal
    python benchmarks/bench_window.py --seq-lens 16384 65536 --repeats 5
    python benchmarks/bench_window.py --tile-rows 512 1024 2048        # the tile-row size B
    python benchmarks/bench_window.py --traffic-only                   # bytes per rank, 4 ranks

Time (one process, fp32 by default, 12 heads x 64, batch 1): the op
(``ring_attention(q, k, v, window_size=(W, 0), is_causal=True)``), forward and
forward + backward, against two floors that take turns with it (A B A B):

- *reach floor*: per tile row of the op's own B rows (each pass its own B),
  one unmasked launch of the same kernel on exactly the keys the row's window
  reaches, [q0 - W, q1) (B + W keys), no merge; forward + backward adds the
  kernel's backward on each backward tile row, given that launch's out and lse.
  What the op would cost if it read its keys once per tile row and masking were
  free.
- *band floor*: per tile row, one unmasked launch on W + 1 keys (as many as
  each query sees): the kernel's speed times the band's pairs, the least any
  exact method with this kernel computes.

Working memory: peak resident memory beyond the inputs (q, k, v; in training also
dout) in a fresh process (/proc/self/clear_refs and VmHWM), what the call returns
included (out; in training dq, dk, dv), in units of one input-sized tensor.

Traffic: the bytes and messages each of P ranks sends in the forward and the backward
of the halo exchange, for contiguous pieces of N / P rows, counted by
``comm.count_communication`` around the op itself: each rank is a process of a
"fake" process group running on meta tensors (the collectives run, no data moves, no
attention is computed), so N = 256K costs seconds. The busiest rank's forward bytes are
compared with W x (one key row + one value row); ``dilated-attention bench --impl ring
--window W --world-sizes 4`` counts the same bytes over real gloo ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Callable, List

import torch

from dilated_attention import ring_attention
from dilated_attention import policy
from dilated_attention import window as windows
from dilated_attention.distributed import comm
from dilated_attention.tools import launch
from dilated_attention.distributed.sharding import piece_lengths
from dilated_attention.kernels import KernelOptions, attention_backward, attention_forward

from bench_single_device import peak_bytes_of, time_cases

HEADS, HEAD_DIM = 12, 64


def make_inputs(n: int, dtype: torch.dtype, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(n)
    # (b, n, h, d)
    return tuple(torch.randn(1, n, HEADS, HEAD_DIM, generator=gen, dtype=dtype)
                 .requires_grad_(requires_grad) for _ in range(3))


def op_step(n: int, window: int, dtype: torch.dtype, backward: bool) -> Callable[[], None]:
    q, k, v = make_inputs(n, dtype, requires_grad=backward)
    dout = torch.randn_like(q)

    def step():
        if backward:
            ring_attention(q, k, v, is_causal=True, window_size=(window, 0)).backward(dout)
        else:
            with torch.no_grad():
                ring_attention(q, k, v, is_causal=True, window_size=(window, 0))

    return step


def floor_step(n: int, window: int, dtype: torch.dtype, backward: bool,
               keys: str) -> Callable[[], None]:
    """One unmasked kernel launch per tile row of the op's B rows (each pass its own B):
    on the keys its window reaches (`keys` "reach") or on window + 1 keys ("band"). The
    backward launches get their out and lse ready, as the op's backward does."""
    q, k, v = make_inputs(n, dtype)
    opts = KernelOptions(causal=False, scale=HEAD_DIM ** -0.5)

    def launches(b_rows: int):
        for q0 in range(0, n, b_rows):
            q1 = min(q0 + b_rows, n)
            k0 = max(0, q0 - window) if keys == "reach" else max(0, q1 - 1 - window)
            # views: the kernel reads them in place, as the op's launches do
            yield q[:, q0:q1], k[:, k0:q1], v[:, k0:q1]

    forward = list(launches(policy.window_tile_rows(window, 0, "cpu", backward=False)))
    backward_launches = []
    if backward:
        for q_b, k_b, v_b in launches(policy.window_tile_rows(window, 0, "cpu", backward=True)):
            out, lse = attention_forward(q_b, k_b, v_b, opts)
            backward_launches.append((q_b, k_b, v_b, out, lse))

    def step():
        for q_b, k_b, v_b in forward:
            attention_forward(q_b, k_b, v_b, opts)
        for q_b, k_b, v_b, out, lse in backward_launches:
            attention_backward(out, q_b, k_b, v_b, out, lse, opts)

    return step


def memory_in_this_process(n: int, window: int, dtype: torch.dtype, training: bool) -> float:
    """Peak bytes of one call beyond its inputs, what it returns included."""
    def call(n):
        q, k, v = make_inputs(n, dtype, requires_grad=training)
        dout = torch.randn_like(q) if training else None

        def step():
            if training:
                out = ring_attention(q, k, v, is_causal=True, window_size=(window, 0))
                out.backward(dout)
                return out, q.grad, k.grad, v.grad
            with torch.no_grad():
                return ring_attention(q, k, v, is_causal=True, window_size=(window, 0))
        return step

    return peak_bytes_of(call, n, warm_up=2 * window + 64)


def memory(n: int, window: int, dtype_name: str, training: bool, tile_rows) -> float:
    """`memory_in_this_process` in a fresh process, with tile rows of `tile_rows` (fwd, bwd)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, __file__, "--memory-case", str(n), str(window), dtype_name,
         str(int(training)), "--tile-rows", *map(str, tile_rows)],
        env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def traffic(ranks: int, seq_lens: List[int], window: int, dtype_name: str) -> List[dict]:
    """Per N, what each rank sends: {"fwd": [(bytes, messages)] per rank, "bwd": ...}."""
    per_rank = []
    for rank in range(ranks):
        out = subprocess.run(
            [sys.executable, __file__, "--traffic-case", str(rank), str(ranks), str(window),
             dtype_name, *map(str, seq_lens)],
            capture_output=True, text=True, check=True)
        per_rank.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return [{"fwd": [tuple(r[i]["fwd"]) for r in per_rank],
             "bwd": [tuple(r[i]["bwd"]) for r in per_rank]} for i in range(len(seq_lens))]


def traffic_in_this_process(rank: int, ranks: int, window: int, dtype: torch.dtype,
                            seq_lens: List[int]) -> List[dict]:
    """This rank of a fake process group: (bytes, messages) it sends in the op's forward and
    backward on meta tensors, contiguous pieces, per N."""
    group = launch.fake_world(rank, ranks)
    counts = []
    for n in seq_lens:
        rows = piece_lengths(n, ranks)[rank]
        # (b, n / P, h, d) on meta: shapes only
        q, k, v = (torch.empty(1, rows, HEADS, HEAD_DIM, dtype=dtype, device="meta",
                               requires_grad=True) for _ in range(3))
        with comm.count_communication() as fwd:
            out = ring_attention(q, k, v, is_causal=True, window_size=(window, 0), group=group)
        with comm.count_communication() as bwd:
            out.backward(torch.empty_like(out))
        counts.append({"fwd": (fwd.bytes_sent, fwd.messages),
                       "bwd": (bwd.bytes_sent, bwd.messages)})
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536])
    parser.add_argument("--window", type=int, default=4096, help="left reach W (causal)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tile-rows", type=int, nargs="+", default=[0],
                        help="query rows per tile row B, forward and backward alike, one table "
                        "each (0: the defaults of policy.WINDOW_TILE_ROWS)")
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--traffic-only", action="store_true")
    parser.add_argument("--traffic-ranks", type=int, default=4)
    parser.add_argument("--traffic-seq-lens", type=int, nargs="+",
                        default=[32768, 65536, 131072, 262144])
    parser.add_argument("--json", default="bench-out/window.json")
    parser.add_argument("--memory-case", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--traffic-case", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.traffic_case:
        rank, ranks, window, dtype_name, *lengths = args.traffic_case
        print(json.dumps(traffic_in_this_process(int(rank), int(ranks), int(window),
                                                 getattr(torch, dtype_name),
                                                 [int(n) for n in lengths])))
        return
    if args.memory_case:
        n, window, dtype_name, training = args.memory_case
        policy.WINDOW_TILE_ROWS["cpu"] = tuple(args.tile_rows)
        print(memory_in_this_process(int(n), int(window), getattr(torch, dtype_name),
                                     bool(int(training))))
        return
    dtype = getattr(torch, args.dtype)
    item = torch.empty(0, dtype=dtype).element_size()
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"h={HEADS} d={HEAD_DIM} batch 1, window ({args.window}, 0) causal, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    bound = args.window * 2 * HEADS * HEAD_DIM * item
    print(f"\ntraffic, {args.traffic_ranks} ranks, contiguous pieces, bytes (messages) each "
          f"rank sends, counted on a fake process group (W x k+v row = {bound:,} bytes):")
    counted = traffic(args.traffic_ranks, args.traffic_seq_lens, args.window, args.dtype)
    for n, sent in zip(args.traffic_seq_lens, counted):
        busiest = max(nbytes for nbytes, _ in sent["fwd"])
        print(f"  N={n:>7}: busiest / (W x k+v row) = {busiest / bound:.3f}")
        for name in ("fwd", "bwd"):
            print(f"    {name}: " + ", ".join(f"{nbytes:,} ({messages})"
                                            for nbytes, messages in sent[name]))
        rows.append(dict(kind="traffic", n=n, ranks=args.traffic_ranks, **sent,
                         ratio=busiest / bound))
    if args.traffic_only:
        _write(args.json, rows)
        return
    print("\n| B (fwd, bwd) | n | pass | op s (min/med/max) | reach floor s | op / reach | band floor s "
          "| op / band | working memory (x input) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b_rows in args.tile_rows:
        _set_tile_rows(b_rows)
        b_rows = "{}, {}".format(*policy.WINDOW_TILE_ROWS["cpu"])
        for n in args.seq_lens:
            input_bytes = n * HEADS * HEAD_DIM * item
            for backward in (False, True):
                mem = memory(n, args.window, args.dtype, backward,
                             policy.WINDOW_TILE_ROWS["cpu"]) / input_bytes
                if args.memory_only:
                    times = None
                else:
                    times = time_cases({
                        "op": op_step(n, args.window, dtype, backward),
                        "reach": floor_step(n, args.window, dtype, backward, "reach"),
                        "band": floor_step(n, args.window, dtype, backward, "band"),
                    }, args.repeats)
                rows.append(dict(kind="time", tile_rows=b_rows, n=n, backward=backward,
                                 times=times, memory=mem))
                pas = "fwd+bwd" if backward else "fwd"
                if times is None:
                    print(f"| {b_rows} | {n} | {pas} | - | - | - | - | - | {mem:.2f} |",
                          flush=True)
                    continue
                med = {name: statistics.median(ts) for name, ts in times.items()}
                spread = {name: "/".join(f"{t:.3f}" for t in (ts[0], med[name], ts[-1]))
                          for name, ts in times.items()}
                print(f"| {b_rows} | {n} | {pas} | {spread['op']} | {spread['reach']} | "
                      f"{med['op'] / med['reach']:.3f} | {spread['band']} | "
                      f"{med['op'] / med['band']:.3f} | {mem:.2f} |", flush=True)
    _write(args.json, rows)


def _set_tile_rows(rows: int) -> None:
    """B for both passes (0: the library's defaults)."""
    if rows:
        policy.WINDOW_TILE_ROWS["cpu"] = (rows, rows)
        windows.window_plan.cache_clear()


def _write(path: str, rows) -> None:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
