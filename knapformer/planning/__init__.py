"""Planning: from sequence lengths to a routing plan, as a pure function.

Topology-aware cost (the workload model), the planner, the history cost model and the
synthetic data mixes. Above the plan contract, below the torch side; no torch.
"""
