"""NaiveDDP, BucketedDDP and SyncBatchNorm against torch, on 2 CPU ranks with gloo."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from utils.launch import run_distributed

TOL = 1e-6  # float32: the sums are done in a different order than in one process


def make_model(seed=0):
    torch.manual_seed(seed + dist.get_rank() if dist.is_initialized() else seed)  # different init per rank
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def data(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world, 6, generator=g), torch.randint(0, 3, (4 * world,), generator=g)


def train(kind, steps=5, accumulate=1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from utils.ddp import BucketedDDP, NaiveDDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    wrapped = {"naive": NaiveDDP, "bucketed": lambda m: BucketedDDP(m, bucket_cap_mb=0.001), "torch": DDP}[kind](model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = data(step, world)
        xr, yr = x[rank::world], y[rank::world]
        opt.zero_grad()
        if accumulate == 1:
            nn.functional.cross_entropy(wrapped(xr), yr).backward()
        else:
            chunks = list(zip(xr.chunk(accumulate), yr.chunk(accumulate)))
            with wrapped.no_sync():
                for cx, cy in chunks[:-1]:
                    (nn.functional.cross_entropy(wrapped(cx), cy) / accumulate).backward()
            cx, cy = chunks[-1]
            (nn.functional.cross_entropy(wrapped(cx), cy) / accumulate).backward()
        opt.step()
    count = getattr(getattr(wrapped, "counter", None), "all_reduces", None)
    return [p.detach().clone() for p in model.parameters()], count


def single_process(steps=5, world=2):
    torch.manual_seed(0)  # rank 0's initialisation, which the wrappers broadcast
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = data(step, world)
        # the mean over ranks of each rank's mean loss = the loss on the union, batches of equal size
        order = torch.cat([torch.arange(r, len(x), world) for r in range(world)])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[order]), y[order]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_equal_to_torch_ddp_and_to_one_process(kind):
    ours = run_distributed(train, 2, kind)
    theirs = run_distributed(train, 2, "torch")
    reference = single_process()
    for rank in range(2):
        assert max_diff(ours[rank][0], theirs[rank][0]) < TOL
        assert max_diff(ours[rank][0], reference) < TOL
    assert max_diff(ours[0][0], ours[1][0]) == 0.0  # ranks identical, bit for bit


def test_bucketed_buckets_and_no_sync():
    plain = run_distributed(train, 2, "bucketed", 5, 1)
    accumulated = run_distributed(train, 2, "bucketed", 5, 2)
    assert max_diff(plain[0][0], accumulated[0][0]) < TOL
    # several buckets per step (tiny cap); with no_sync the first of two backward passes sends nothing
    assert plain[0][1] == accumulated[0][1] > 5


def _unused_parameters(kind):
    from utils.ddp import BucketedDDP, NaiveDDP

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head_a, self.head_b, self.never = nn.Linear(3, 4), nn.Linear(4, 1), nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            h = self.body(x)
            return self.head_a(h) if dist.get_rank() == 0 else self.head_b(h)  # each rank skips one head

    torch.manual_seed(0)
    model = TwoHeads()
    wrapped = BucketedDDP(model, bucket_cap_mb=0.00001) if kind == "bucketed" else NaiveDDP(model)
    wrapped(torch.ones(2, 3)).sum().backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def test_unused_parameters_do_not_hang_and_are_averaged():
    grads = run_distributed(_unused_parameters, 2, "bucketed", timeout=30)
    assert grads[0]["never.weight"] is None and grads[1]["never.weight"] is None  # no rank produced one
    for name in ("head_a.weight", "head_b.weight", "body.weight"):
        assert torch.equal(grads[0][name], grads[1][name])  # the same averaged gradient on both ranks
    # head_a was used on rank 0 only: its averaged gradient is rank 0's divided by the world size
    assert grads[0]["head_a.weight"].abs().sum() > 0


def test_naive_ddp_with_unused_parameters_silently_mixes_gradients():
    # The per-parameter design pairs collectives by call order, not by parameter: rank 0 all-reduces
    # head_a's gradients while rank 1 all-reduces head_b's (same shapes), so gloo sums the wrong
    # tensors without complaint and the replicas end up with different gradients. This is why
    # BucketedDDP (and torch DDP) reduce fixed buckets that name every parameter on every rank.
    grads = run_distributed(_unused_parameters, 2, "naive", timeout=30)
    assert grads[0]["head_a.weight"] is not None and grads[1]["head_a.weight"] is None
    assert grads[0]["head_b.weight"] is None and grads[1]["head_b.weight"] is not None


def _sync_bn(shape):
    from utils.ddp import SyncBatchNorm

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(*shape, generator=g) * 3 + 1
    w = torch.randn(*shape, generator=g)
    n = shape[0] // world
    x = x_all[rank * n:(rank + 1) * n].clone().requires_grad_()
    bn = SyncBatchNorm(shape[1])
    out = bn(x)
    (out * w[rank * n:(rank + 1) * n]).sum().backward()
    return out.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var


@pytest.mark.parametrize("shape", [(8, 3), (6, 4, 5, 5)])
def test_sync_batchnorm_equals_full_batch_batchnorm(shape):
    results = run_distributed(_sync_bn, 2, shape)
    g = torch.Generator().manual_seed(0)
    x_all = (torch.randn(*shape, generator=g) * 3 + 1).requires_grad_()
    w = torch.randn(*shape, generator=g)
    bn = nn.BatchNorm1d(shape[1]) if len(shape) == 2 else nn.BatchNorm2d(shape[1])
    out = bn(x_all)
    (out * w).sum().backward()
    n = shape[0] // 2
    for rank, (o, gx, gw, gb, rm, rv) in enumerate(results):
        assert torch.allclose(o, out[rank * n:(rank + 1) * n].detach(), atol=1e-5)
        assert torch.allclose(gx, x_all.grad[rank * n:(rank + 1) * n], atol=1e-5)
        assert torch.allclose(rm, bn.running_mean, atol=1e-6) and torch.allclose(rv, bn.running_var, atol=1e-5)
    # parameter gradients: each rank holds its part; their sum is the full-batch gradient
    assert torch.allclose(results[0][2] + results[1][2], bn.weight.grad, atol=1e-5)
    assert torch.allclose(results[0][3] + results[1][3], bn.bias.grad, atol=1e-5)


def test_wrappers_need_a_process_group_and_valid_arguments():
    from utils.ddp import BucketedDDP, NaiveDDP, SyncBatchNorm

    with pytest.raises(RuntimeError, match="init_process_group"):
        NaiveDDP(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        BucketedDDP(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"expected input of shape \(N, 3"):
        SyncBatchNorm(3)(torch.zeros(4, 2))
