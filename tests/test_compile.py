"""The single-device op under torch.compile: one graph, no breaks, same results."""

import warnings

import pytest
import torch

from dilated_attention import (MultiheadDilatedAttention, dilated_attention, recommended_dtype,
                               ring_attention, rotary_tables)
from dilated_attention.kernels import KernelOptions


@pytest.mark.parametrize("causal", [False, True])
def test_fullgraph_compile_matches_eager(causal: bool) -> None:
    """fullgraph=True raises on any graph break; outputs and gradients equal eager mode."""
    torch.manual_seed(0)
    # (b, n, h, d) with GQA, a tail segment and rates that do not divide h
    q = torch.randn(1, 300, 6, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 300, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 300, 2, 16, dtype=torch.float64, requires_grad=True)

    def attend(q, k, v):
        return dilated_attention(q, k, v, [64, 128], [1, 4], is_causal=causal, return_lse=True)

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    out_c, lse_c = compiled(q, k, v)
    out_e, lse_e = attend(q, k, v)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    torch.testing.assert_close(lse_c, lse_e, rtol=0, atol=0)
    dout = torch.randn_like(out_e)
    grads_c = torch.autograd.grad(out_c, (q, k, v), dout)
    grads_e = torch.autograd.grad(out_e, (q, k, v), dout)
    for got, want in zip(grads_c, grads_e):
        # the traced backward may sum dq over patterns in another order: fp64 rounding
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_double_backward_of_a_compiled_call() -> None:
    """create_graph through a compiled call: Dynamo alone (backend="eager") keeps the custom
    op's autograd, so the double backward equals eager's; AOTAutograd (aot_eager, inductor)
    refuses it with torch's own RuntimeError, as docs/compile.md says, never wrong numbers."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))

    def attend(q, k, v):
        return dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True)

    def double_backward(fn):
        grads = torch.autograd.grad(fn(q, k, v).square().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v))

    torch._dynamo.reset()
    for got, want in zip(double_backward(torch.compile(attend, backend="eager")),
                         double_backward(attend)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        double_backward(torch.compile(attend, backend="aot_eager"))


def test_importing_the_library_leaves_dynamo_unloaded() -> None:
    """Dynamo is imported by what compiles, not by the library: importing it took a second
    more than torch's own import, in every process and every spawned rank."""
    import subprocess
    import sys

    code = ("import sys, dilated_attention, dilated_attention.integrations.transformers; "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_recommended_dtype_off_cuda_is_float32() -> None:
    assert recommended_dtype("cpu") == torch.float32
    assert recommended_dtype(torch.device("meta")) == torch.float32


def _compiled_runs(fn, calls, backend="aot_eager"):
    """Compile `fn` once (fullgraph) and run it on each call's args (inputs whose dim 1 is
    marked dynamic), forward and backward; return (compiled results, warnings raised).

    The first call compiles; every later one must reuse its graph: a recompile is an error.
    aot_eager traces the backward too (AOTAutograd), as inductor does, without generating
    code.
    """
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    results = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i, (args, kwargs) in enumerate(calls):
            for x in args:
                if isinstance(x, torch.Tensor):
                    torch._dynamo.mark_dynamic(x, 1)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = compiled(*args, **kwargs)
            leaves = [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad]
            results.append((out, torch.autograd.grad(out[0].square().sum(), leaves)))
    return results, [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
                     for w in seen]


def _masked_calls(lengths, heads: int, head_dim: int):
    """One call per length: (2, n, heads, head_dim) q with GQA (2 kv heads), float64, and a
    padding mask that ignores the last 5 keys of row 1."""
    calls = []
    for n in lengths:
        q = torch.randn(2, n, heads, head_dim, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, n, 2, head_dim, dtype=torch.float64, requires_grad=True)
                for _ in range(2))
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[1, -5:] = True
        calls.append(((q, k, v, mask), {}))
    return calls


def _assert_compiled_equals_eager(attend, calls) -> None:
    """`attend` compiled once for every call (``_compiled_runs``), no warning raised: out and
    lse equal eager mode's, gradients to fp64 rounding (the traced backward may get dout in
    other strides, or sum dq over patterns in another order)."""
    results, seen = _compiled_runs(attend, calls)
    assert seen == []
    for (args, _), ((out, lse), grads) in zip(calls, results):
        want_out, want_lse = attend(*args)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
        want = torch.autograd.grad(want_out.square().sum(), args[:3])
        for got, w in zip(grads, want):
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)


def test_dynamic_sequence_length_compiles_once() -> None:
    """mark_dynamic on the sequence length: one graph serves every length (no
    ConstraintViolationError, no recompile), equal to eager, and no warning while compiling."""
    torch.manual_seed(0)

    def attend(q, k, v, mask):
        return dilated_attention(q, k, v, [64, 128], [1, 4], is_causal=True, return_lse=True,
                                 key_padding_mask=mask)

    _assert_compiled_equals_eager(attend, _masked_calls((300, 301, 517), 6, 16))


@pytest.mark.parametrize("window", [(8, 0), (5, 3)])
def test_sliding_window_compiles_once(window) -> None:
    """ring_attention with a sliding window (a custom op pair, as the dilated op): one graph
    for every length, documents and a padding mask included, equal to eager."""
    torch.manual_seed(0)

    def attend(q, k, v, mask):
        return ring_attention(q, k, v, is_causal=window[1] == 0, window_size=window,
                              cu_seqlens=[0, 7, q.shape[1]], key_padding_mask=mask,
                              return_lse=True)

    _assert_compiled_equals_eager(attend, _masked_calls((40, 41, 67), 4, 8))


def test_module_with_dynamic_length_compiles_once() -> None:
    """MultiheadDilatedAttention as bench_compile.py compiles it: one graph for all lengths."""
    torch.manual_seed(0)
    attn = MultiheadDilatedAttention(32, 4, [64, 128], [1, 2], num_kv_heads=2)
    xs = [torch.randn(1, n, 32, requires_grad=True) for n in (200, 333)]
    results, seen = _compiled_runs(attn, [((x, x, x), {"is_causal": True}) for x in xs])
    assert seen == []
    for x, ((out, _), _) in zip(xs, results):
        torch.testing.assert_close(out, attn(x, x, x, is_causal=True)[0])


def test_static_rotary_tables_beside_a_dynamic_length_raise_torchs_error() -> None:
    """rotary tables of a fixed length beside a length marked dynamic: the tables' check
    specialises the length, which torch reports as a ConstraintViolationError (as for a
    static key_padding_mask). It once raised the check's own ValueError naming two equal
    shapes ("must be of shape (40, 1, 4) ..., got ... (40, 1, 4)"): `in` compared them."""
    torch._dynamo.reset()
    attn = MultiheadDilatedAttention(32, 4, [8, 16], [1, 2], num_kv_heads=2)
    compiled = torch.compile(attn, backend="eager", fullgraph=True)
    x = torch.randn(1, 40, 32)
    torch._dynamo.mark_dynamic(x, 1)
    rotary = rotary_tables(torch.arange(40), head_dim=8)
    with pytest.raises(Exception, match="marked .* as dynamic") as error:
        compiled(x, x, x, is_causal=True, rotary=rotary)
    assert "rotary's cos must be of shape" not in str(error.value)
    # the tables marked dynamic too: one graph, equal to eager
    for n in (40, 57):
        x = torch.randn(1, n, 32)
        rotary = rotary_tables(torch.arange(n), head_dim=8)
        for t in (x, *rotary):
            torch._dynamo.mark_dynamic(t, 1 if t is x else 0)
        torch.testing.assert_close(compiled(x, x, x, is_causal=True, rotary=rotary)[0],
                                   attn(x, x, x, is_causal=True, rotary=rotary)[0])


def _assert_model_compiles_like_eager(model, compiled, tokens, targets, *, recompile: bool,
                                      **kwargs) -> None:
    """The compiled model's training forward (recompiling only if `recompile`) gives eager's
    loss and gradients."""
    results = []
    for fn in (compiled, model):
        model.zero_grad(set_to_none=True)
        with torch._dynamo.config.patch(error_on_recompile=not recompile):
            loss = fn(tokens, targets, **kwargs)[1]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_c, grads_c), (loss_e, grads_e) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads_c, grads_e):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("positions", ["sinusoidal", "rotary"])
def test_model_with_dynamic_length_compiles_once(positions) -> None:
    """LongNetLM's training forward (the chunked loss, a custom op pair like the attention)
    compiles into ONE graph (fullgraph: the id checks, which read the ids, are skipped while
    tracing) that serves every length marked dynamic (the loss's chunk loop, traced, fixed
    the length: ConstraintViolationError; the id checks' graph break made the agreed piece
    lengths constants: a recompile per length) and equals eager, loss and gradients (rotary:
    the turn's compiled branch, torch.cat of the halves, too)."""
    from dilated_attention import LongNetConfig, LongNetLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LongNetConfig(vocab_size=19, embed_dim=16, num_heads=4, ffn_dim=24, num_layers=1,
                           segment_lengths=(4, 8), dilation_rates=(1, 2), positions=positions,
                           loss_chunk_bytes=5 * 19 * 8)  # chunks of 5 rows: several per call
    model = LongNetLM(config, dtype=torch.float64)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for i, n in enumerate((18, 23, 31)):
        tokens, targets = (torch.randint(0, 19, (2, n), generator=torch.Generator().manual_seed(s))
                           for s in (n, n + 1))
        for x in (tokens, targets):
            torch._dynamo.mark_dynamic(x, 1)
        _assert_model_compiles_like_eager(model, compiled, tokens, targets, recompile=i == 0)


def test_model_with_packed_documents_compiles_fullgraph() -> None:
    """LongNetLM with cu_seqlens lists compiles without a graph break, as the op does: the
    first list specialises, the second recompiles with symbolic boundaries, which serves the
    third; loss and gradients equal eager."""
    from dilated_attention import LongNetConfig, LongNetLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LongNetConfig(vocab_size=19, embed_dim=16, num_heads=4, ffn_dim=24, num_layers=1,
                           segment_lengths=(4, 8), dilation_rates=(1, 2), positions="rotary")
    model = LongNetLM(config, dtype=torch.float64)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens, targets = torch.randint(0, 19, (2, 30)), torch.randint(0, 19, (2, 30))
    for i, cu_seqlens in enumerate(([0, 5, 30], [0, 11, 30], [0, 17, 30])):
        _assert_model_compiles_like_eager(model, compiled, tokens, targets, recompile=i < 2,
                                          cu_seqlens=cu_seqlens)


def test_model_with_position_ids_breaks_only_where_it_reads_them() -> None:
    """Restarting position_ids are read on the host (the documents they mark): graph breaks
    there, but none in the library's own code after them (`max(..., default=None)` was one:
    Dynamo cannot trace the keyword); loss equal to eager."""
    from torch._dynamo.utils import counters

    from dilated_attention import LongNetConfig, LongNetLM

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = LongNetConfig(vocab_size=19, embed_dim=16, num_heads=4, ffn_dim=24, num_layers=1,
                           segment_lengths=(4, 8), dilation_rates=(1, 2))
    model = LongNetLM(config, dtype=torch.float64)
    tokens, targets = torch.randint(0, 19, (2, 18)), torch.randint(0, 19, (2, 18))
    positions = torch.cat([torch.arange(5), torch.arange(13)])
    loss = torch.compile(model, backend="aot_eager")(tokens, targets, position_ids=positions)[1]
    torch.testing.assert_close(loss, model(tokens, targets, position_ids=positions)[1],
                               rtol=1e-12, atol=1e-12)
    reasons = list(counters["graph_break"])
    assert reasons and not [r for r in reasons if "handle op max" in r]


def test_encoder_decoder_compiles_once() -> None:
    """LongNet (encoder-decoder): one graph for every pair of source and target lengths
    marked dynamic, loss equal to eager."""
    from dilated_attention import LongNet, LongNetConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LongNetConfig(vocab_size=19, embed_dim=16, num_heads=4, ffn_dim=24, num_layers=1,
                           num_encoder_layers=1, segment_lengths=(4, 8), dilation_rates=(1, 2))
    model = LongNet(config, dtype=torch.float64)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for i, (n, m) in enumerate(((18, 9), (23, 12), (31, 17))):
        source, target = torch.randint(0, 19, (2, n)), torch.randint(0, 19, (2, m))
        for x in (source, target):
            torch._dynamo.mark_dynamic(x, 1)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss = compiled(source, target, target)[1]
        torch.testing.assert_close(loss, model(source, target, target)[1], rtol=1e-12, atol=0)



class _SelfAttention(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x):
        return self.attn(x, x, x, is_causal=True)[0]


def test_export_serves_every_length() -> None:
    """torch.export with the sequence length dynamic: the program the module and the model
    export into (the custom ops, not their launches) gives eager's output at lengths it was
    not exported at, and the model's exported training graph eager's loss and gradients."""
    from dilated_attention import LongNetConfig, LongNetLM

    torch.manual_seed(0)
    length = torch.export.Dim("length", min=2, max=4096)
    attn = _SelfAttention(MultiheadDilatedAttention(32, 4, [64, 128], [1, 2], num_kv_heads=2))
    program = torch.export.export(attn, (torch.randn(1, 200, 32),),
                                  dynamic_shapes=({1: length},)).module()
    for n in (77, 333):
        x = torch.randn(1, n, 32)
        torch.testing.assert_close(program(x), attn(x))

    config = LongNetConfig(vocab_size=19, embed_dim=16, num_heads=4, ffn_dim=24, num_layers=1,
                           segment_lengths=(4, 8), dilation_rates=(1, 2), positions="rotary")
    model = LongNetLM(config, dtype=torch.float64)
    # two tensors: export reads one tensor passed twice as the same input, for every call
    example = torch.randint(0, 19, (2, 18)), torch.randint(0, 19, (2, 18))
    program = torch.export.export(model, example,
                                  dynamic_shapes=({1: length}, {1: length})).module()
    for n in (23, 31):
        tokens, targets = torch.randint(0, 19, (2, n)), torch.randint(0, 19, (2, n))
        results = []
        for fn, parameters in ((program, list(program.parameters())),
                               (model, list(model.parameters()))):
            loss = fn(tokens, targets)[1]
            results.append((loss.detach(), torch.autograd.grad(loss, parameters)))
        (loss_x, grads_x), (loss_e, grads_e) = results
        torch.testing.assert_close(loss_x, loss_e, rtol=1e-12, atol=1e-12)
        for got, want in zip(grads_x, grads_e):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _compiled_across_ranks(group):
    """On each rank: (the compiled op, ring_attention and LongNetLM without fullgraph against
    eager: largest differences of out, ring out, loss and gradients; whether fullgraph
    refused the model; the warnings the compiled model raised)."""
    from dilated_attention import LongNetConfig, LongNetLM, shard_sequence

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, 37, 4, 8, dtype=torch.float64, generator=g),
                              group) for _ in range(3))

    def attend(q, k, v):
        return dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True, group=group)

    def dense(q, k, v):
        return ring_attention(q, k, v, is_causal=True, group=group)

    diffs = [float((torch.compile(fn, backend="aot_eager")(q, k, v) - fn(q, k, v)).abs().max())
             for fn in (attend, dense)]
    config = LongNetConfig(vocab_size=19, embed_dim=16, num_heads=4, ffn_dim=24, num_layers=1,
                           segment_lengths=(4, 8), dilation_rates=(1, 2))
    torch.manual_seed(0)
    model = LongNetLM(config, dtype=torch.float64, process_group=group)
    tokens, targets = (shard_sequence(torch.randint(0, 19, (2, 37), generator=g), group)
                       for _ in range(2))
    results = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="aot_eager")
        # the second compiled call, after an eager one, traced into the agreement's pickling
        for fn in (compiled, model, compiled):
            model.zero_grad(set_to_none=True)
            loss = fn(tokens, targets)[1]
            loss.backward()
            results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_e, grads_e) = results[1]
    diffs.append(max(float((loss_c - loss_e).abs()) for loss_c, _ in results[::2]))
    diffs.append(max(float((a - b).abs().max())
                     for _, grads_c in results[::2] for a, b in zip(grads_c, grads_e)))
    torch._dynamo.reset()
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(tokens, targets)
        refused = False
    except Exception:  # Dynamo's error for the graph break, whatever its class
        refused = True
    return diffs, refused, [f"{w.category.__name__}: {w.message}" for w in seen]


@pytest.mark.distributed
def test_sequence_parallel_calls_run_eagerly_inside_compiled_code():
    """torch.compile without fullgraph of the ops with a group and of a sequence-parallel
    LongNetLM: the sharded attention runs eagerly, a graph break between compiled code (traced,
    its agreement and exchange failed: TorchRuntimeError on symbolic sizes), and the results
    equal eager's, without a warning (the model's agreement, traced into, made Dynamo warn
    that it cannot trace pickle.dumps); fullgraph=True is still an error, not a silent graph."""
    from dist_harness import run_distributed

    for diffs, refused, seen in run_distributed(_compiled_across_ranks, 2, timeout=300):
        assert seen == []
        out, ring, loss, grads = diffs
        assert out == ring == loss == 0.0
        assert grads < 1e-12  # the compiled layers may sum in another order
        assert refused

# recommended_dtype follows the compute capability on every side of its thresholds; the GPU
# is faked, so this runs without one (test_cuda's version needs the GPU it asks about).

@pytest.mark.parametrize("capability,dtype", [((6, 1), torch.float32), ((7, 0), torch.float16),
                                              ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                              ((9, 0), torch.bfloat16)])
def test_recommended_dtype_at_each_compute_capability(monkeypatch, capability, dtype):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert recommended_dtype("cuda") == dtype


# The custom ops' fake (shape-only) implementations give what the real ops give, dtypes
# included: for fp64 inputs the lse is fp64. A compiled graph trusts the fake: with an fp32
# fake lse, `lse.float()` is dropped as a no-op and an fp64 tensor flows on (aot_eager).

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_custom_ops_fakes_match_the_real_ops(dtype):
    from dilated_attention import dilated
    from dilated_attention.patterns import Heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 8, generator=g, dtype=dtype) for _ in range(3))
    call = dilated.LocalCall(((8, 16), (1, 2)), KernelOptions(True, 8 ** -0.5, "cpu_flash"),
                             Heads.of(2, 2), None, False)
    torch.library.opcheck(dilated._forward_op, (q, k, v, *call.flat(), None, None, False),
                          test_utils=("test_faketensor",))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_loss_ops_fake_matches_the_real_op(dtype):
    """The chunked loss's forward op: its lse in the accumulator dtype (fp32 for a half
    dtype, fp64 for fp64) in the fake as in the real op."""
    from dilated_attention.models import loss
    g = torch.Generator().manual_seed(0)
    hidden, weight = (torch.randn(*shape, generator=g).to(dtype) for shape in ((7, 4), (5, 4)))
    targets = torch.randint(0, 5, (7,), generator=g)
    torch.library.opcheck(loss._forward_op, (hidden, weight, None, targets, 3, dtype),
                          test_utils=("test_faketensor",))
