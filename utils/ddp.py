"""Data parallelism from scratch: what ``DistributedDataParallel`` does, piece by piece.

- ``NaiveDDP``: the design of the source article. Broadcast parameters and
  buffers from rank 0, then all-reduce every gradient as soon as autograd has
  accumulated it (one collective per parameter tensor). It sums and then divides
  by the world size, which works on every backend and torch version
  (``ReduceOp.AVG`` is missing from ``gloo`` in older releases).
- ``BucketedDDP``: gradients grouped into buckets of about ``bucket_cap_mb`` in
  reverse registration order (roughly the order backward produces them); a
  bucket's all-reduce starts asynchronously as soon as its last gradient is
  ready, so communication overlaps the rest of the backward pass, and all of
  them are awaited at the end of backward. ``no_sync()`` skips the communication
  for gradient accumulation. Parameters that get no gradient on some rank are
  handled (zeros are sent, and a gradient that no rank produced stays ``None``).
  ``overlap=False`` starts every bucket at the end of backward (for comparison).
- ``record_backward`` and ``launches_before_last_gradient``: the order in which
  gradients arrive and all-reduces start in a backward pass: proof of overlap.
- ``SyncBatchNorm``: statistics of the global batch: per-rank count, mean and
  M2 in float32, gathered by a differentiable all-gather and merged with the
  parallel formula. torch's ``nn.SyncBatchNorm`` runs only on accelerators; this
  one runs on CPU with ``gloo``.

All of them are checked against torch in ``tests/test_ddp.py``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ._checks import check_int

__all__ = ["NaiveDDP", "BucketedDDP", "SyncBatchNorm", "broadcast_module",
           "CollectiveCounter", "record_backward", "launches_before_last_gradient",
           "merge_moments"]


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group is initialised: "
                           "call torch.distributed.init_process_group() first")


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Make every rank start from rank ``src``'s parameters and buffers."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src=src)


class CollectiveCounter:
    """Counts the all-reduces a wrapper issues (the number the chapter compares)."""

    def __init__(self) -> None:
        self.all_reduces = 0


class NaiveDDP(nn.Module):
    """One all-reduce per parameter, started in its post-accumulate-grad hook
    (the source article's design)."""

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
        # SUM then divide: ReduceOp.AVG is missing from older gloo builds
        dist.all_reduce(param.grad)
        param.grad.div_(self.world_size)
        self.counter.all_reduces += 1

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.buffer = None  # gradients, then one "this rank has it" flag each
        self.ready = 0
        self.work = None

    def pack(self) -> None:
        """Flatten the gradients into one buffer (missing ones: zeros)."""
        # on the gradients' device: one buffer, one all-reduce (nccl refuses CPU)
        first = self.params[0]
        flags = torch.tensor([p.grad is not None for p in self.params],
                             dtype=first.dtype, device=first.device)
        grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                 for p in self.params]
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
    """Bucketed, overlapped gradient all-reduce with ``no_sync()``; see the module
    docstring."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0,
                 overlap: bool = True) -> None:
        super().__init__()
        _require_process_group()
        cap_mb = bucket_cap_mb
        number = isinstance(cap_mb, (int, float)) and not isinstance(cap_mb, bool)
        if not number or cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {cap_mb!r}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        self.module = module
        self.world_size = dist.get_world_size()
        self.counter = CollectiveCounter()
        self.require_sync = True
        self.overlap = overlap
        self._callback_queued = False
        broadcast_module(module)
        params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            names = sorted(map(str, dtypes))
            raise TypeError(f"BucketedDDP needs one parameter dtype, got {names}")
        cap = bucket_cap_mb * 2**20
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):  # backward produces gradients roughly in reverse
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
        """Accumulate gradients locally; the first backward after the block
        synchronises the sum. Unlike torch's DDP, which reads the flag in forward,
        this one reads it during backward."""
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
        # Buckets start in bucket order on every rank (collectives must match).
        full = bucket.ready == len(bucket.params)
        if self.overlap and full and b == self._next_bucket:
            while self._next_bucket < len(self.buckets):
                nxt = self.buckets[self._next_bucket]
                if nxt.ready != len(nxt.params):
                    break
                self._launch(nxt)
                self._next_bucket += 1

    def _finish(self) -> None:
        """End of backward: launch what is left (unused parameters send zeros),
        wait, write the averaged gradients back."""
        self._callback_queued = False
        for bucket in self.buckets[self._next_bucket:]:
            self._launch(bucket)
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.unpack(self.world_size)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@contextlib.contextmanager
def record_backward(module: nn.Module) -> Iterator[list[tuple[str, str | int]]]:
    """Record, in order, each parameter gradient computed (``("grad", name)``)
    and each all-reduce started through ``torch.distributed.all_reduce``
    (``("all_reduce", numel)``) while the block runs.

    The gradient events come from tensor hooks, which run before the gradient is
    accumulated, so before any wrapper's post-accumulate hook can start an
    all-reduce for it.
    """
    events: list[tuple[str, str | int]] = []
    handles = [p.register_hook(lambda grad, name=name: events.append(("grad", name)))
               for name, p in module.named_parameters() if p.requires_grad]
    original = dist.all_reduce

    def logged(tensor, *args, **kwargs):
        events.append(("all_reduce", tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = logged
    try:
        yield events
    finally:
        dist.all_reduce = original
        for handle in handles:
            handle.remove()


def launches_before_last_gradient(events: list) -> tuple[int, int]:
    """(all-reduces started while gradients were still to come, all started)."""
    grads = [i for i, (kind, _) in enumerate(events) if kind == "grad"]
    launches = [i for i, (kind, _) in enumerate(events) if kind == "all_reduce"]
    if not grads:
        return 0, len(launches)
    return sum(i < grads[-1] for i in launches), len(launches)


class _AllGather(torch.autograd.Function):
    """Stack every rank's tensor, differentiably: the gradient of rank r's entry
    is the sum over ranks of the gradients their outputs send to it."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[dist.get_rank()]


def merge_moments(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor):
    """Merge per-part (count, mean, M2) into those of the union: the parallel
    formula of Chan et al., as torch's ``batch_norm_gather_stats_with_counts``.

    ``counts`` has shape ``(P, 1)``, ``means`` and ``m2s`` ``(P, C)``; M2 is the
    sum of squared deviations from the part's own mean, so no large number is
    ever squared and then subtracted.
    """
    n = counts.sum()
    mean = (counts * means).sum(0) / n
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return n, mean, m2


class SyncBatchNorm(nn.Module):
    """BatchNorm with the statistics of the global batch over all ranks.

    Inputs are ``(N, C)`` or ``(N, C, *spatial)``; ranks may hold different ``N``
    (zero included). In training mode each rank computes its count, mean and M2
    (sum of squared deviations) per channel in float32 with two passes over its
    data, one differentiable all-gather collects every rank's, and they are
    merged in float32 with the parallel formula (as torch's ``nn.SyncBatchNorm``
    does). The output is computed in float32 and returned in the input's dtype.
    Running statistics use the unbiased variance, as ``nn.BatchNorm`` does. In
    eval mode it is an ordinary BatchNorm. Runs on CPU, with any backend.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True) -> None:
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

    def _global_moments(self, xf: torch.Tensor, dims: list[int]):
        count = xf.numel() // self.num_features
        if count > 0:
            var, mean = torch.var_mean(xf, dims, correction=0)  # two passes, float32
            m2 = var * count
        else:  # zeros kept in the graph: every rank runs the backward all-reduce
            mean = m2 = xf.sum(dims)
        counts = torch.full((1,), float(count), device=xf.device)
        local = torch.cat([counts, mean, m2])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every = _AllGather.apply(local)
        else:
            every = local[None]
        C = self.num_features
        return merge_moments(every[:, :1], every[:, 1:C + 1], every[:, C + 1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"expected input of shape (N, {self.num_features}, ...), "
                             f"got {tuple(x.shape)}")
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()
        if self.training:
            n, mean, m2 = self._global_moments(xf, dims)
            if n < 2:
                raise ValueError("expected more than 1 value per channel when "
                                 f"training, got {int(n)}")
            var = m2 / n
            with torch.no_grad():
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(m * mean.to(self.running_mean.dtype))
                unbiased = (var * n / (n - 1)).to(self.running_var.dtype)
                self.running_var.mul_(1 - m).add_(m * unbiased)
        else:
            mean, var = self.running_mean.float(), self.running_var.float()
        y = (xf - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.weight is not None:
            weight, bias = self.weight.float(), self.bias.float()
            y = y * weight.reshape(shape) + bias.reshape(shape)
        return y.to(x.dtype)
