"""The capture in each worker: hooks on decoder layers, the step's attribution and the
rank meeting, the CUDA path, pipeline stages, and what speculators' RPC drivers see."""
