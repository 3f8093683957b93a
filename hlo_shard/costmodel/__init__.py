"""The cost model: what one step of a module costs per device on a hardware profile.

``flops`` (flops, transcendentals and bytes by XLA's cost-analysis rules), ``kernels``
(the kernels XLA would fuse the instructions into), ``memory`` (buffer liveness and peak
memory), ``network`` (the α-β model of collectives) and ``step_time`` (the roofline per
kernel that puts them together into :class:`~hlo_shard.costmodel.step_time.StepEstimate`).
Nothing here runs a pass: what the sharding pass plans is handed in by the caller.
"""
