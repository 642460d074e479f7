"""NaiveDDP, BucketedDDP and SyncBatchNorm against torch, on 2 to 4 CPU ranks with gloo."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from utils.ddp import BucketedDDP
from utils.launch import run_distributed

TOL = 1e-5  # float32: the same sums in another order (BatchNorm over 2 samples amplifies it)
SIZES = (5, 2, 3)  # uneven local batches on 3 ranks


class Net(nn.Module):
    """Linear, a normalisation layer, Linear, and a plain buffer that scales the output."""

    def __init__(self, norm):
        from utils.ddp import SyncBatchNorm

        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        layers = {"none": nn.Identity, "batchnorm": nn.BatchNorm1d, "syncbatchnorm": SyncBatchNorm}
        self.norm = layers[norm](16) if norm != "none" else nn.Identity()
        self.fc2 = nn.Linear(16, 3)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x)))) * self.scale


def make_model(norm, seed):
    """Parameters *and buffers* differ with the seed, so the wrappers' broadcasts must work."""
    torch.manual_seed(seed)
    model = Net(norm)
    with torch.no_grad():
        model.scale.fill_(1.0 + 0.25 * seed)
        if norm != "none":
            model.norm.running_mean.normal_()
            model.norm.running_var.uniform_(0.5, 2.0)
    return model


def global_batch(step, total):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(total, 6, generator=g), torch.randint(0, 3, (total,), generator=g)


def parts(sizes):
    """The slice of the global batch each rank takes."""
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes)]


def state(model):
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def wrap(kind, model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from utils.ddp import NaiveDDP

    return {"naive": NaiveDDP,
            "bucketed": lambda m: BucketedDDP(m, bucket_cap_mb=0.0001),  # 2 or 3 buckets
            "torch": DDP,
            "torch, no buffer sync": lambda m: DDP(m, forward_sync_buffers=False)}[kind](model)


def train(kind, norm, sizes, steps=3, accumulate=1):
    rank = dist.get_rank()
    model = make_model(norm, seed=rank)
    wrapped = wrap(kind, model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(step, sum(sizes))
        xr, yr = x[parts(sizes)[rank]], y[parts(sizes)[rank]]
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
    return state(model), getattr(getattr(wrapped, "counter", None), "all_reduces", None)


def one_process(norm, sizes, steps=3, loss="mean over ranks"):
    """What the ranks train, in one process.

    DDP averages the gradients *over ranks*; each rank's loss is the mean over *its* samples.
    So the objective is the mean over ranks of the per-rank mean losses, which weighs a sample
    by 1 / (world_size * its rank's batch size): with uneven batches it is not the mean loss
    over the union (``loss="mean over samples"``). Plain BatchNorm normalises each rank's part
    with that part's statistics; SyncBatchNorm normalises with the union's, as one BatchNorm
    over the whole global batch does.
    """
    model = make_model("batchnorm" if norm == "syncbatchnorm" else norm, seed=0)  # rank 0's
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(step, sum(sizes))
        opt.zero_grad()
        if norm == "batchnorm":
            out = torch.cat([model(x[p]) for p in parts(sizes)])
        else:
            out = model(x)
        per_sample = nn.functional.cross_entropy(out, y, reduction="none")
        if loss == "mean over ranks":
            torch.stack([per_sample[p].mean() for p in parts(sizes)]).mean().backward()
        else:
            per_sample.mean().backward()
        opt.step()
    return state(model)


def max_diff(a, b, names=None):
    names = names or [n for n in a if n in b and a[n].is_floating_point()]
    return max(float((a[n] - b[n]).abs().max()) for n in names)


PARAMS = [n for n, _ in Net("batchnorm").named_parameters()]
BN_BUFFERS = ["norm.running_mean", "norm.running_var"]


@functools.lru_cache(maxsize=None)
def torch_ddp(norm, kind="torch"):
    return run_distributed(train, len(SIZES), kind, norm, SIZES)


@pytest.mark.parametrize("norm", ["batchnorm", "syncbatchnorm"])
@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_equal_to_torch_ddp_and_to_one_process_with_uneven_batches(kind, norm):
    ours = run_distributed(train, len(SIZES), kind, norm, SIZES)
    theirs = torch_ddp(norm)
    reference = one_process(norm, SIZES)
    same = PARAMS if norm == "batchnorm" else None  # plain BatchNorm's buffers stay per rank
    for rank in range(len(SIZES)):
        assert max_diff(ours[rank][0], ours[0][0], same) == 0.0  # identical, bit for bit
        assert max_diff(ours[rank][0], theirs[rank][0], PARAMS) < TOL
        assert max_diff(ours[rank][0], reference, PARAMS) < TOL
        assert ours[rank][0]["scale"].item() == 1.0  # rank 0's buffer, broadcast at construction
    # with uneven batches DDP does not minimise the mean loss over all samples
    assert max_diff(ours[0][0], one_process(norm, SIZES, loss="mean over samples"), PARAMS) > 1e-3
    if norm == "syncbatchnorm":  # global statistics: running stats equal one BatchNorm's
        for rank in range(len(SIZES)):
            assert max_diff(ours[rank][0], reference, BN_BUFFERS) < TOL


def test_buffers_are_broadcast_at_construction_only_unlike_torch_ddp():
    # Plain BatchNorm: each rank's running statistics follow its own batches. torch's DDP
    # broadcasts rank 0's buffers at every forward (forward_sync_buffers=True, the default),
    # BucketedDDP only once, at construction: the same as torch with forward_sync_buffers=False.
    ours = run_distributed(train, len(SIZES), "bucketed", "batchnorm", SIZES)
    synced, unsynced = torch_ddp("batchnorm"), torch_ddp("batchnorm", "torch, no buffer sync")
    assert max_diff(ours[0][0], synced[0][0], BN_BUFFERS) < TOL  # rank 0 is never overwritten
    for rank in (1, 2):
        assert max_diff(ours[rank][0], synced[rank][0], BN_BUFFERS) > 1e-2
        assert max_diff(ours[rank][0], unsynced[rank][0], BN_BUFFERS) < TOL


def test_bucketed_buckets_and_no_sync():
    sizes = (4, 6, 8)  # even sizes per rank: two accumulated halves equal one batch
    plain = run_distributed(train, 3, "bucketed", "none", sizes, 3, 1)
    accumulated = run_distributed(train, 3, "bucketed", "none", sizes, 3, 2)
    assert max_diff(plain[0][0], accumulated[0][0]) < TOL
    # several buckets per step (tiny cap); with no_sync the first of two backward passes sends nothing
    assert plain[0][1] == accumulated[0][1] == 2 * 3  # 2 buckets, 3 steps


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head_a, self.head_b = nn.Linear(3, 4), nn.Linear(4, 1), nn.Linear(4, 1)
        self.never = nn.Linear(4, 1)

    def forward(self, x, rank):
        h = self.body(x)
        return self.head_a(h) if rank == 0 else self.head_b(h)  # each rank skips one head


def _unused_parameters(kind):
    from utils.ddp import NaiveDDP

    torch.manual_seed(0)
    model = TwoHeads()
    wrapped = BucketedDDP(model, bucket_cap_mb=0.00001) if kind == "bucketed" else NaiveDDP(model)
    wrapped(torch.ones(2, 3), dist.get_rank()).sum().backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def local_gradients(rank):
    """Rank ``rank``'s gradients without any communication."""
    torch.manual_seed(0)
    model = TwoHeads()
    model(torch.ones(2, 3), rank).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_unused_parameters_do_not_hang_and_are_averaged():
    grads = run_distributed(_unused_parameters, 2, "bucketed", timeout=30)
    g0, g1 = local_gradients(0), local_gradients(1)
    for rank in range(2):
        assert grads[rank]["never.weight"] is None  # no rank produced one
        # head_a was used on rank 0 only: its average is rank 0's gradient / world size
        assert torch.allclose(grads[rank]["head_a.weight"], g0["head_a.weight"] / 2, atol=TOL)
        assert torch.allclose(grads[rank]["head_b.weight"], g1["head_b.weight"] / 2, atol=TOL)
        body = (g0["body.weight"] + g1["body.weight"]) / 2
        assert torch.allclose(grads[rank]["body.weight"], body, atol=TOL)
    assert g0["head_a.weight"].abs().sum() > 0  # so the checks above are not 0 == 0


def test_naive_ddp_with_unused_parameters_silently_mixes_gradients():
    # The per-parameter design pairs collectives by call order, not by parameter: rank 0
    # all-reduces head_a's gradients while rank 1 all-reduces head_b's (same shapes), so gloo
    # sums the wrong tensors without complaint and the replicas end up with different
    # gradients. This is why BucketedDDP (and torch DDP) reduce fixed buckets that name every
    # parameter on every rank.
    grads = run_distributed(_unused_parameters, 2, "naive", timeout=30)
    assert grads[0]["head_a.weight"] is not None and grads[1]["head_a.weight"] is None
    assert grads[0]["head_b.weight"] is None and grads[1]["head_b.weight"] is not None
    g0, g1 = local_gradients(0), local_gradients(1)
    mixed = (g0["head_a.weight"] + g1["head_b.weight"]) / 2
    assert torch.allclose(grads[0]["head_a.weight"], mixed, atol=TOL)


# Overlap: an all-reduce must start while backward still has gradients to compute.


class LaunchAllAtEnd(BucketedDDP):
    """A mutant: the same buckets and results, but no bucket starts during backward."""

    def _grad_ready(self, param):
        if self.require_sync and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)


def _backward_trace():
    from utils.ddp import launches_before_last_gradient, record_backward

    variants = {"real": BucketedDDP, "mutant": LaunchAllAtEnd,
                "overlap=False": functools.partial(BucketedDDP, overlap=False)}
    result = {}
    for name, cls in variants.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
        wrapped = cls(model, bucket_cap_mb=0.004)  # 4 KiB: one Linear (4.1 KiB) each
        loss = wrapped(torch.randn(8, 32)).square().mean()
        with record_backward(model) as events:
            loss.backward()
        result[name] = (launches_before_last_gradient(events), len(wrapped.buckets),
                        [p.grad.clone() for p in model.parameters()])
    return result


@functools.lru_cache(maxsize=None)
def backward_trace():
    return run_distributed(_backward_trace, 2)[0]


def test_buckets_start_during_backward():
    (early, launched), buckets, _ = backward_trace()["real"]
    assert buckets == 6 and launched == buckets
    assert early == buckets - 1  # all but the bucket that holds the very last gradient


def test_overlap_check_fails_for_a_wrapper_that_starts_all_buckets_at_the_end():
    real_grads = backward_trace()["real"][2]
    for variant in ("mutant", "overlap=False"):
        (early, launched), buckets, grads = backward_trace()[variant]
        assert launched == buckets == 6 and early == 0  # what test_buckets_... would catch
        assert all(torch.equal(a, b) for a, b in zip(grads, real_grads))  # same gradients


# SyncBatchNorm against BatchNorm on the whole global batch: a large mean with a small spread
# (where E[x^2] - E[x]^2 cancels catastrophically) and bfloat16 input.
# case: (dtype, mean, std, spatial shape, tolerance relative to the largest reference value)
BN_CASES = {
    "float32 (N, C), mean 1, std 3": (torch.float32, 1.0, 3.0, (), 1e-5),
    "float32, mean 0, std 1": (torch.float32, 0.0, 1.0, (4, 4), 1e-5),
    "float32, mean 100, std 0.1": (torch.float32, 100.0, 0.1, (4, 4), 1e-4),
    "float32, mean 1000, std 0.1": (torch.float32, 1000.0, 0.1, (4, 4), 1e-3),
    "bfloat16, mean 10, std 1": (torch.bfloat16, 10.0, 1.0, (4, 4), 2**-7),
}


def _bn_batch(total, dtype, mean, std, spatial):
    g = torch.Generator().manual_seed(0)
    shape = (total, 3, *spatial)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * std + mean).to(dtype)
    upstream = torch.randn(shape, generator=g)
    weight, bias = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    return x, upstream, weight, bias


def _bn_step(bn, x, upstream, weight, bias):
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    x = x.clone().requires_grad_()
    out = bn(x)
    (out.float() * upstream).sum().backward()
    return out.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var


def _sync_bn_rank(sizes, case):
    from utils.ddp import SyncBatchNorm

    x, upstream, weight, bias = _bn_batch(sum(sizes), *BN_CASES[case][:4])
    part = parts(sizes)[dist.get_rank()]
    return _bn_step(SyncBatchNorm(3), x[part], upstream[part], weight, bias)


def relative_error(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("case, sizes", [(c, (5, 1, 2)) for c in BN_CASES]
                         + [("float32, mean 100, std 0.1", (3, 0, 5, 2))])
def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(case, sizes):
    dtype, mean, std, spatial, tol = BN_CASES[case]
    results = run_distributed(_sync_bn_rank, len(sizes), sizes, case)
    x, upstream, weight, bias = _bn_batch(sum(sizes), dtype, mean, std, spatial)
    bn = nn.BatchNorm2d(3) if spatial else nn.BatchNorm1d(3)
    out, grad_x, grad_w, grad_b, running_mean, running_var = _bn_step(bn, x, upstream, weight, bias)
    assert torch.cat([r[0] for r in results]).dtype == dtype
    assert relative_error(torch.cat([r[0] for r in results]), out) <= tol
    assert relative_error(torch.cat([r[1] for r in results]), grad_x) <= tol
    # parameter gradients: each rank holds its part; their sum is the full-batch gradient
    assert relative_error(sum(r[2] for r in results), grad_w) <= tol
    assert relative_error(sum(r[3] for r in results), grad_b) <= tol
    for r in results:  # the same global statistics on every rank
        assert relative_error(r[4], running_mean) <= 1e-5
        assert relative_error(r[5], running_var) <= 1e-5


def test_wrappers_need_a_process_group_and_valid_arguments():
    from utils.ddp import NaiveDDP, SyncBatchNorm

    with pytest.raises(RuntimeError, match="init_process_group"):
        NaiveDDP(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        BucketedDDP(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"expected input of shape \(N, 3"):
        SyncBatchNorm(3)(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SyncBatchNorm(3)(torch.zeros(1, 3))
