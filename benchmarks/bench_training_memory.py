"""Peak memory and time of one LongNetLM training step, per checkpoint mode.

    python benchmarks/bench_training_memory.py                   # tiny, vocab 32,000, N = 8,192
    python benchmarks/bench_training_memory.py --seq-len 2048 --repeats 1
    python benchmarks/bench_training_memory.py --modes none layers --repeats 5   # time cost
    python benchmarks/bench_training_memory.py --return-logits   # the loss from whole logits
    python benchmarks/bench_training_memory.py --positions rotary  # RoPE in every block
    python benchmarks/bench_training_memory.py --preset base --layers 2 --seq-len 16384 \
        --modes layers --ffn-chunk-bytes 16777216          # the feed-forward over chunks

A step is forward, backward and an AdamW step on one sequence of --seq-len
tokens with random targets. Each case runs in a fresh subprocess: large
tensors mmapped (so that each leaves the resident set when freed), one
warm-up step on 64 tokens (imports, AdamW's state, first-use costs), the
heap's free memory handed back (malloc_trim), then the measured steps. Peak
memory is the growth above the process before the step's forward (CPU:
/proc/self/clear_refs and VmHWM, the package's PeakMemory; CUDA: the
allocator's peak), through backward ("fwd+bwd") and through the optimizer
step too ("step": its own peak on top of the gradients backward left), in
MiB and in units of one fp32 logits tensor (batch x tokens x vocabulary x 4
bytes), the unit of issue 26's target. Times (the whole step): min and
median over --repeats steps, and the median over the "none" case's (issue
26's target: "layers" at most 1.4x). "estimate": ``estimate --model``'s
formula (tools/estimate/model.py) for the same step, less the parameters and
AdamW's moments, which exist before the step; "/ step": estimate over the
measured step peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import torch

from dilated_attention import LongNetConfig, LongNetLM
from dilated_attention.tools.bench import PeakMemory
from dilated_attention.tools.launch import limit_malloc_caching

MODES = ("none", "layers", "offload")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=("tiny", "base"))
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=0, help="override the preset's num_layers")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--positions", default="sinusoidal",
                   choices=("sinusoidal", "learned", "rotary"))
    p.add_argument("--ffn-chunk-bytes", type=int, default=None,
                   help="LongNetConfig.ffn_chunk_bytes: the feed-forward over chunks of rows")
    p.add_argument("--attention-dropout", type=float, default=0.0,
                   help="LongNetConfig.attention_dropout (the op then runs its blockwise kernel)")
    p.add_argument("--return-logits", action="store_true",
                   help="compute the loss from the whole logits (the path before issue 26)")
    p.add_argument("--repeats", type=int, default=1, help="measured steps per case")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-estimate", dest="estimate", action="store_false",
                   help="skip the column of estimate --model's formula")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a subprocess's one case
    return p.parse_args(argv)


def model_config(args: argparse.Namespace, mode: str) -> LongNetConfig:
    layers = {"num_layers": args.layers} if args.layers else {}
    return LongNetConfig.from_name(args.preset, vocab_size=args.vocab, checkpoint=mode,
                                   max_seq_len=max(args.seq_len, 256),
                                   ffn_chunk_bytes=args.ffn_chunk_bytes,
                                   positions=args.positions,
                                   attention_dropout=args.attention_dropout, **layers)


def estimated_growth(args: argparse.Namespace, mode: str) -> int:
    """``estimate --model``'s formula for the step's peak, less what exists before the step
    (parameters and AdamW's moments): the quantity measured here."""
    from dilated_attention.tools.estimate import model

    config = model_config(args, mode)
    setup = model.ModelSetup(args.preset, config, args.seq_len, 1, args.batch, args.dtype,
                             "cuda" if args.device.startswith("cuda") else "cpu",
                             args.threads or torch.get_num_threads(), None)
    peak = model.formula(setup, mode, model.op_working_bytes(setup)[0]).peak_bytes
    return peak - 3 * model.parameter_counts(config)[0] * setup.torch_dtype.itemsize


def run_case(args: argparse.Namespace, mode: str) -> Dict[str, object]:
    """One mode's measured steps, in this process."""
    # large tensors mmapped, so that each leaves the RSS when freed: else glibc keeps the
    # warm-up's freed blocks in the heap (malloc_trim returns only its top) and later steps
    # reuse them without raising the high-water mark (tiny's layers step read 124 MiB for
    # 86 MiB of tensors)
    limit_malloc_caching()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = model_config(args, mode)
    torch.manual_seed(0)
    model = LongNetLM(config, device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)

    def step(n: int, measure: bool = False) -> Dict[str, int]:
        tokens, targets = torch.randint(0, args.vocab, (2, args.batch, n), generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        activations = PeakMemory(args.device)
        activations.start()
        _, loss = model(tokens, targets, return_logits=args.return_logits)
        loss.backward()
        sync()
        backward = activations.peak_bytes()  # before the next start() resets the high-water mark
        update = PeakMemory(args.device)
        update.start()
        opt.step()
        sync()
        if not measure or backward is None:
            return {}
        # the optimizer's peak sits on what backward left (the gradients)
        return {"backward": backward,
                "step": max(backward, update.base - activations.base + update.peak_bytes())}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    step(64)
    _release_free_heap()
    times: List[float] = []
    peaks: Dict[str, int] = {}
    for _ in range(args.repeats):
        start = time.perf_counter()
        for key, value in step(args.seq_len, measure=True).items():
            peaks[key] = max(peaks.get(key, 0), value)
        times.append(time.perf_counter() - start)
    logits_bytes = args.batch * args.seq_len * args.vocab * 4
    return {"mode": mode, **{f"{key}_bytes": value for key, value in peaks.items()},
            **{f"{key}_logits": value / logits_bytes for key, value in peaks.items()},
            "min_s": min(times), "median_s": statistics.median(times)}


def _release_free_heap() -> None:
    """Return the C heap's free memory to the system (glibc), so that the measured step's
    allocations show in the RSS instead of reusing what the warm-up freed."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case is not None:
        print(json.dumps(run_case(args, args.case)))
        return 0
    passed = list(argv if argv is not None else sys.argv[1:])
    layers = f", {args.layers} layers" if args.layers else ""
    ffn = "" if args.ffn_chunk_bytes is None else \
        f", feed-forward over chunks of {args.ffn_chunk_bytes / 2**20:g} MiB"
    ffn += f", attention dropout {args.attention_dropout:g}" if args.attention_dropout else ""
    print(f"LongNetLM {args.preset}{layers}, vocabulary {args.vocab}, {args.batch} x "
          f"{args.seq_len} tokens, {args.dtype} on {args.device}{ffn}, {args.positions} "
          f"positions; loss "
          f"{'from whole logits' if args.return_logits else 'over chunks'}; one fp32 logits "
          f"tensor = {args.batch * args.seq_len * args.vocab * 4 / 2**20:.0f} MiB")
    print(f"{'checkpoint':>10}  {'fwd+bwd peak':>12}  {'/ logits':>8}  {'step peak':>12}  "
          f"{'/ logits':>8}  {'min s':>8}  {'median s':>8}  {'/ none':>6}"
          + (f"  {'estimate':>12}  {'/ step':>6}" if args.estimate else ""))
    none_median = None
    for mode in args.modes:
        out = subprocess.run([sys.executable, __file__, *passed, "--case", mode],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"case {mode} failed:\n{out.stderr}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        cells = [f"{row[f'{key}_bytes'] / 2**20:8.0f} MiB  {row[f'{key}_logits']:8.3f}"
                 if f"{key}_bytes" in row else f"{'n/a':>12}  {'n/a':>8}"
                 for key in ("backward", "step")]
        none_median = row["median_s"] if mode == "none" else none_median
        ratio = f"{row['median_s'] / none_median:6.3f}" if none_median else f"{'n/a':>6}"
        line = (f"{mode:>10}  {'  '.join(cells)}  {row['min_s']:8.3f}  {row['median_s']:8.3f}  "
                f"{ratio}")
        if args.estimate and not args.return_logits:
            growth = estimated_growth(args, mode)
            measured = row.get("step_bytes")
            line += f"  {growth / 2**20:8.0f} MiB  " + (
                f"{growth / measured:6.3f}" if measured else f"{'n/a':>6}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
