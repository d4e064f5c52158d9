"""Test worker: rank BAD_RANK raises; the others wait in a collective that can never complete."""
import sys

import torch
import torch.distributed as dist

bad_rank = int(sys.argv[1])
dist.init_process_group("gloo")
if dist.get_rank() == bad_rank:
    raise RuntimeError(f"rank {bad_rank} failed on purpose")
dist.all_reduce(torch.zeros(1))  # blocks: the failing rank never joins
