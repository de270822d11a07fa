"""The trainer: replay batches in, GRPO steps on FSDP2 (or Megatron-Core), weights out to rollout."""
