"""Scheduling, host-only and torch-free: the scheduler, its policies and the KV block accounting."""
