"""Cluster-scale failure simulation: seeded failure traces at 256 to 100,000 GPUs, ours and
other systems' policies as whole systems (detection, mitigation, recovery), goodput over a
week against the best healthy plan. Pure numpy on top of the perfmodel and scheduler."""
