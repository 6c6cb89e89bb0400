"""The distributed core: every torch.distributed call (comm), sequence sharding, the
training reductions (gradients), sequence-parallel dilated attention, the ring, the halo
exchange and Ulysses."""
