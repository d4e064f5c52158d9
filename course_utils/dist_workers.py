"""The code each process runs in notebook 07's multi-process demos (launched by
:func:`course_utils.distributed.launch`, which has already called ``init_process_group``).

Spawned processes import their function by name, so it has to live in a module, not in a
notebook cell; the notebook prints these functions so learners read what runs.

- :func:`data_parallel_worker`: the same small MLP trained with DDP (every rank holds
  everything) and with FSDP2 ``fully_shard`` (every rank holds a shard), on each rank's half of
  the batch; returns per-rank bytes, losses, the full gradients and the final weights.
- :func:`tensor_parallel_worker`: a Linear split column-wise and row-wise across the ranks, and
  Megatron's MLP (column-parallel, then row-parallel, one all-reduce).
- :func:`hang_worker`, :func:`failing_worker`, :func:`rank_info_worker`: tiny workers the tests use.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .distributed import local_state_bytes, rank_device
from .models import mlp


def build_mlp(in_features: int, width: int, n_classes: int, n_layers: int = 2, *, seed: int = 0) -> nn.Sequential:
    """The demo MLP, built from ``seed`` so every process (and the notebook) starts from the same weights."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}.")
    with torch.random.fork_rng():  # same weights in every process, the caller's RNG untouched
        torch.manual_seed(seed)
        net = mlp(n_layers=n_layers, width=width, in_features=in_features, n_classes=n_classes)
    return nn.Sequential(*list(net)[1:])  # no Flatten: the demo feeds flat vectors


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """The rows of a global batch of ``n`` that ``rank`` trains on (``n`` must divide evenly)."""
    if n % world_size:
        raise ValueError(f"global batch {n} does not split evenly over {world_size} ranks; "
                         f"use a multiple of {world_size}.")
    per = n // world_size
    return slice(rank * per, (rank + 1) * per)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to the whole tensor on every rank (a collective), or ``t``; on the CPU."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().cpu().clone()


def _train(model, x, y, *, steps: int, lr: float, world_size: int):
    """Plain training loop on this rank's data; the global loss is the mean over ranks.

    Returns the optimizer, the losses, and the full gradients of the first backward (when every
    run still has the same weights, so any difference is float rounding).
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, first_grads = [], None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP all-reduces, FSDP reduce-scatters the gradients (averaged over ranks)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
        if step == 0:  # full_tensor() all-gathers a sharded gradient: every rank must call it
            inner = getattr(model, "module", model)  # DDP wraps the model as .module
            first_grads = {n: _full(p.grad) for n, p in inner.named_parameters()}
        optimizer.step()
    return optimizer, losses, first_grads


def data_parallel_worker(x: torch.Tensor, y: torch.Tensor, *, steps: int = 3, lr: float = 1e-3, width: int = 64,
                         n_layers: int = 2, seed: int = 0) -> dict:
    """Train the same MLP with DDP and with FSDP2 on this rank's share of ``(x, y)``.

    ``steps`` Adam steps. Returns, per strategy, this rank's bytes (parameters, gradients, Adam
    state), the losses, the full gradients of the first step and the final weights.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    part = rank_slice(len(x), rank, world)
    xr, yr = x[part].to(device), y[part].to(device)
    n_classes = int(y.max()) + 1
    out = {"rank": rank, "world_size": world, "backend": dist.get_backend()}

    # Data parallelism: a full replica per rank, gradients all-reduced.
    model = build_mlp(x.shape[1], width, n_classes, n_layers, seed=seed).to(device)
    ddp = DDP(model)  # one full replica per rank
    optimizer, losses, grads = _train(ddp, xr, yr, steps=steps, lr=lr, world_size=world)
    out["ddp"] = {"bytes": local_state_bytes(model, optimizer), "losses": losses, "grads": grads,
                  "params": {n: _full(p) for n, p in model.named_parameters()}}
    del ddp, model, optimizer

    # FSDP2: every Linear's parameters (and so its gradients and Adam state) sharded over the ranks.
    mesh = init_device_mesh(device.type, (world,))  # explicit: one dimension over all ranks, on our device type
    model = build_mlp(x.shape[1], width, n_classes, n_layers, seed=seed).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer, losses, grads = _train(model, xr, yr, steps=steps, lr=lr, world_size=world)
    out["fsdp"] = {"bytes": local_state_bytes(model, optimizer), "losses": losses, "grads": grads,
                   "param_type": type(next(model.parameters())).__name__,
                   "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
                   "params": {n: _full(p) for n, p in model.named_parameters()}}
    return out


def tensor_parallel_worker(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                           b2: torch.Tensor) -> dict:
    """Split Linear layers across the ranks and rebuild their outputs with collectives.

    - column-parallel ``y = x @ w1.T + b1``: rank r holds rows r of ``w1`` (output features),
      computes its slice of ``y``; ``all_gather`` concatenates the slices.
    - row-parallel ``z = h @ w2.T + b2``: rank r holds columns r of ``w2`` (input features) and
      the matching slice of ``h``; each computes a partial sum, ``all_reduce`` adds them.
    - Megatron MLP ``gelu(x @ w1.T + b1) @ w2.T + b2``: column-parallel then row-parallel, the
      GeLU runs on the local slice, and the only communication is one all-reduce.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    x, w1, b1, w2, b2 = (t.to(device) for t in (x, w1, b1, w2, b2))
    hidden = w1.shape[0]
    if hidden % world or w2.shape[1] != hidden:
        raise ValueError(f"w1 has {hidden} output features and w2 {w2.shape[1]} inputs: both must be equal "
                         f"and divisible by {world} ranks.")
    cols = rank_slice(hidden, rank, world)
    w1_local, b1_local = w1[cols].contiguous(), b1[cols].contiguous()   # column-parallel shard
    w2_local = w2[:, cols].contiguous()                                  # row-parallel shard

    # 1. Column-parallel Linear + all_gather.
    y_local = x @ w1_local.T + b1_local
    pieces = [torch.empty_like(y_local) for _ in range(world)]
    dist.all_gather(pieces, y_local)
    y_col = torch.cat(pieces, dim=-1)

    # 2. Row-parallel Linear on the full input h = y_col: each rank takes its slice of features.
    h_local = y_col[..., cols]
    z_row = h_local @ w2_local.T
    dist.all_reduce(z_row)        # sum of the partial products
    z_row = z_row + b2            # the bias is added once, after the sum

    # 3. Megatron MLP: no gather in between; one all-reduce at the end.
    a_local = F.gelu(x @ w1_local.T + b1_local)
    mlp_out = a_local @ w2_local.T
    dist.all_reduce(mlp_out)
    mlp_out = mlp_out + b2

    weight_bytes = sum(t.numel() * t.element_size() for t in (w1_local, b1_local, w2_local))
    return {"rank": rank, "column_parallel": y_col.cpu(), "row_parallel": z_row.cpu(), "megatron_mlp": mlp_out.cpu(),
            "local_weight_bytes": weight_bytes,
            "local_shapes": {"w1": tuple(w1_local.shape), "w2": tuple(w2_local.shape)}}


def rank_info_worker(value: float = 1.0) -> dict:
    """Each rank contributes ``value * (rank + 1)``; the all-reduced sum proves the group works."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([value * (rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world, "backend": dist.get_backend(), "sum": t.item(),
            "pid": __import__("os").getpid()}


def hang_worker(pid_dir: str) -> None:
    """Writes its PID to ``pid_dir`` and then never returns (the launcher's timeout must kill it)."""
    import os

    with open(os.path.join(pid_dir, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.1)


def failing_worker(bad_rank: int = 1) -> int:
    """Rank ``bad_rank`` raises; the others wait in a collective that can never complete."""
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"rank {bad_rank} failed on purpose")
    t = torch.zeros(1)
    dist.all_reduce(t)  # blocks: the failing rank never joins
    return dist.get_rank()
