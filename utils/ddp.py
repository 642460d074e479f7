"""Data parallelism from scratch: what ``DistributedDataParallel`` does, in three small pieces.

- ``NaiveDDP``: the design of the source article. Broadcast parameters and buffers from rank 0,
  then all-reduce every gradient as soon as autograd has accumulated it (one collective per
  parameter tensor). It sums and then divides by the world size, which works on every backend
  and torch version (``ReduceOp.AVG`` is missing from ``gloo`` in older releases).
- ``BucketedDDP``: gradients grouped into buckets of about ``bucket_cap_mb`` in reverse registration
  order (roughly the order backward produces them); a bucket's all-reduce starts asynchronously as
  soon as its last gradient is ready, so communication overlaps the rest of the backward pass, and
  all of them are awaited at the end of backward. ``no_sync()`` skips the communication for
  gradient accumulation. Parameters that get no gradient on some rank are handled (zeros are sent,
  and a gradient that no rank produced stays ``None``).
- ``SyncBatchNorm``: batch statistics over the global batch, through a differentiable all-reduce
  of (sum, sum of squares, count). torch's ``nn.SyncBatchNorm`` only runs on CUDA; this one runs
  on CPU with ``gloo`` for teaching and testing.

All three are checked against torch in ``tests/test_ddp.py``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ._checks import check_int

__all__ = ["NaiveDDP", "BucketedDDP", "SyncBatchNorm", "broadcast_module", "CollectiveCounter"]


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group is initialised: call torch.distributed.init_process_group() first")


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Make every rank start from rank ``src``'s parameters and buffers (BatchNorm statistics included)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src=src)


class CollectiveCounter:
    """Counts the all-reduces a wrapper issues (the number the chapter compares)."""

    def __init__(self) -> None:
        self.all_reduces = 0


class NaiveDDP(nn.Module):
    """One all-reduce per parameter, started in its post-accumulate-grad hook (the source article's design)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        _require_process_group()
        self.module = module
        self.world_size = dist.get_world_size()
        self.counter = CollectiveCounter()
        broadcast_module(module)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._average)

    def _average(self, param: torch.Tensor) -> None:
        dist.all_reduce(param.grad)  # SUM then divide: ReduceOp.AVG is missing from older gloo builds
        param.grad.div_(self.world_size)
        self.counter.all_reduces += 1

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.buffer = None  # gradients, then one "this rank produced a gradient" flag per parameter
        self.ready = 0
        self.work = None

    def pack(self) -> None:
        """Flatten the gradients into one buffer with a single concatenation (missing ones as zeros)."""
        # on the gradients' device: one buffer, one all-reduce (nccl refuses CPU tensors)
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=self.params[0].dtype,
                             device=self.params[0].device)
        grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in self.params]
        self.buffer = torch.cat(grads + [flags])

    def unpack(self, world_size: int) -> None:
        """Write the averaged gradients back (in place where a gradient exists)."""
        grads = self.buffer[:self.numel].div_(world_size).split(self.sizes)
        produced = self.buffer[self.numel:].tolist()
        have, new = [], []
        for p, g, flag in zip(self.params, grads, produced):
            if flag == 0:  # no rank produced this gradient: leave it as it is
                continue
            if p.grad is None:
                p.grad = g.view_as(p).clone()
            else:
                have.append(p.grad)
                new.append(g.view_as(p))
        if have:
            torch._foreach_copy_(have, new)
        self.buffer, self.ready, self.work = None, 0, None


class BucketedDDP(nn.Module):
    """Bucketed, overlapped gradient all-reduce with ``no_sync()``; see the module docstring."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        _require_process_group()
        if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        self.module = module
        self.world_size = dist.get_world_size()
        self.counter = CollectiveCounter()
        self.require_sync = True
        self._callback_queued = False
        broadcast_module(module)
        params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise TypeError(f"BucketedDDP needs one parameter dtype, got {sorted(map(str, dtypes))}")
        cap = bucket_cap_mb * 2**20
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):  # backward produces gradients roughly in reverse order
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        self._next_bucket = 0
        self._bucket_of = {}
        for b, bucket in enumerate(self.buckets):
            for p in bucket.params:
                self._bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._grad_ready)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronises the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _launch(self, bucket: _Bucket) -> None:
        bucket.pack()
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self.counter.all_reduces += 1

    def _grad_ready(self, param: nn.Parameter) -> None:
        # Kept small: it runs once per parameter tensor in every backward pass.
        if not self.require_sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self._bucket_of[param]
        bucket = self.buckets[b]
        bucket.ready += 1
        # Buckets start in bucket order on every rank (collectives must match across ranks).
        if bucket.ready == len(bucket.params) and b == self._next_bucket:
            while self._next_bucket < len(self.buckets):
                nxt = self.buckets[self._next_bucket]
                if nxt.ready != len(nxt.params):
                    break
                self._launch(nxt)
                self._next_bucket += 1

    def _finish(self) -> None:
        """End of backward: launch what is left (unused parameters send zeros), wait, write gradients back."""
        self._callback_queued = False
        for bucket in self.buckets[self._next_bucket:]:
            self._launch(bucket)
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.unpack(self.world_size)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks, differentiable: the gradient of a sum that every rank uses is the sum of their gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class SyncBatchNorm(nn.Module):
    """BatchNorm whose training statistics are those of the global batch over all ranks (CPU, any backend).

    Inputs are ``(N, C)`` or ``(N, C, *spatial)``. In training mode each rank computes per-channel
    sum, sum of squares and count, all-reduces them (one collective per forward, differentiable), and
    normalises with the global mean and biased variance; running statistics use the unbiased
    variance, as ``nn.BatchNorm`` does. In eval mode it is an ordinary BatchNorm.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True) -> None:
        super().__init__()
        self.num_features = check_int("num_features", num_features, minimum=1)
        self.eps, self.momentum = eps, momentum
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features))
            self.bias = nn.Parameter(torch.zeros(num_features))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"expected input of shape (N, {self.num_features}, ...), got {tuple(x.shape)}")
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        if self.training:
            count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
            stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                stats = _AllReduceSum.apply(stats)
            C = self.num_features
            total, total_sq, n = stats[:C], stats[C:2 * C], stats[2 * C]
            mean = total / n
            var = total_sq / n - mean * mean
            with torch.no_grad():
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        else:
            mean, var = self.running_mean, self.running_var
        y = (x - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + self.eps)
        if self.weight is not None:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y
