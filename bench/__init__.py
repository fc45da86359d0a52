"""Benchmarks of xdp-agg against torch.distributed gloo on the same netns testbed (issue 5)."""
