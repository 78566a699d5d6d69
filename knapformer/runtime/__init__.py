"""The torch side a training job runs: the balancer, its gathers and exchanges, the
step timer, plan-ahead and the recorder. The only layer of the core that imports
``torch.distributed``.
"""
