"""Tensor-parallel executors: the processes (or Ray actors) that hold the other ranks of a
model split with tensor parallelism, and the channel that hands them each step.

Rank 0 lives in the engine core's process beside the scheduler (`TensorParallelExecutor`);
ranks 1..N-1 are worker processes (`process_workers`, the default `mp` backend) or Ray actors in
one placement group (`ray_workers`, `--distributed-executor-backend ray`). All ranks join one
torch.distributed group (gloo on CPU, NCCL plus a gloo control group on CUDA).
"""
