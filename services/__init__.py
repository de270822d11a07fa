"""Flywheel: asynchronous GRPO post-training as independent services."""
