"""Test worker: each rank contributes value * (rank + 1); the all-reduced sum proves the group works.

Usage (under the launcher or torchrun): rank_info.py VALUE OUT_DIR; writes OUT_DIR/rank<r>.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

value, out_dir = float(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.tensor([value * (rank + 1)])
dist.all_reduce(t)
info = {"rank": rank, "world_size": dist.get_world_size(), "backend": dist.get_backend(), "sum": t.item(),
        "pid": os.getpid(), "threads": torch.get_num_threads()}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(info, f)
print(f"rank {rank} of {info['world_size']}: sum {info['sum']}")
dist.destroy_process_group()
