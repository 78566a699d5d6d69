"""Plan one step without any process group: the planner is a pure function.

Run: ``python docs/examples/plan_offline.py`` (docs/concepts.md shows its output).
"""

from knapformer import WorkloadModel, plan_routing

plan = plan_routing(
    [[4096, 1200], [16384], [300, 300, 300], [900]],  # sequence lengths on each GPU
    "g1n2+g2n1",  # two 1-GPU bags and one bag of 2 GPUs
    WorkloadModel(token_dim=3072, gamma=0.4),
)
print("bags:", plan.bags)
seqs = plan.sequences
for i in range(len(seqs)):
    chunks = plan.chunks.dst_gpu[plan.chunks.seq == i].tolist()
    print(
        f"sequence {i}: GPU {seqs.src_gpu[i]}, {seqs.length[i]:>5} tokens -> bag {seqs.bag[i]}, "
        f"chunks on GPUs {chunks}"
    )
st = plan.stats
print(
    f"imbalance {st.imbalance_before:.2f} -> {st.imbalance_after:.2f}, "
    f"makespan/LB {st.makespan_over_lb:.3f}, "
    f"moved {st.moved_tokens:,} of {st.total_tokens:,} tokens"
)
