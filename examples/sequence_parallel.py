"""Sequence-parallel dilated and ring attention under torchrun.

    torchrun --nproc-per-node 2 examples/sequence_parallel.py

Every rank builds the same full tensors (for the demo only: in a real model
each rank computes just its own piece), keeps its piece, and checks that
its rows of the sequence-parallel result equal the single-device result.
"""

import torch
import torch.distributed as dist

from dilated_attention import dilated_attention, ring_attention, shard_sequence

dist.init_process_group("gloo")
group = dist.group.WORLD
torch.manual_seed(0)
# (batch, seq_len, heads, head_dim): any length, pieces may differ by a row
q, k, v = (torch.randn(1, 10_001, 12, 64) for _ in range(3))
q_local, k_local, v_local = (shard_sequence(x, group) for x in (q, k, v))

out_local = dilated_attention(q_local, k_local, v_local, [2048, 4096], [1, 2], group=group)
dense_local = ring_attention(q_local, k_local, v_local, is_causal=True, group=group)

rows = shard_sequence(torch.arange(q.shape[1]), group, dim=0)
single = dilated_attention(q, k, v, [2048, 4096], [1, 2])[:, rows]
dense = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
).transpose(1, 2)[:, rows]
torch.testing.assert_close(out_local, single, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(dense_local, dense, rtol=1e-5, atol=1e-5)
print(
    f"rank {dist.get_rank()}: rows {rows[0].item()}..{rows[-1].item()} equal the single-device "
    f"result (max error dilated {(out_local - single).abs().max().item():.1e}, "
    f"ring {(dense_local - dense).abs().max().item():.1e})"
)
dist.destroy_process_group()
