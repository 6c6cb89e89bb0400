"""The distributed core: every torch.distributed call (comm), sequence sharding,
sequence-parallel dilated attention and ring attention."""
