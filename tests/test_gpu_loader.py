"""utils.gpu_loader on CPU tensors (the same code runs on CUDA): the batched
augmentation equals the plain per-sample reference image by image; torchvision's crop
and flip give the same images for the same draws; the order is ShardSampler's, shard
by shard; a loader started at any batch yields the rest of the epoch exactly; the
draws are a pure function of (seed, epoch, index), evenly spread; the loop converts
nothing to Python; no index tensor is larger than one per image; resident_bytes is the
peak of every allocation, measured; bad input is refused with a message."""

import inspect
import math

import numpy as np
import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from utils import gpu_loader
from utils.gpu_loader import (CIFAR_MEAN, CIFAR_STD, GPULoader, augment_batch,
                              augment_draws, count_ops, reference_augment,
                              resident_bytes, sample_draws)
from utils.samplers import ShardSampler


def images(n, height=32, width=32, channels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, height, width, channels), dtype=torch.uint8,
                         generator=g)


DATA = images(75)
LABELS = torch.arange(75)  # label = index: the batches' labels name their samples


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def as_on_a_gpu(loader):
    """The loader as it runs on a GPU (the whole epoch at once), here on the CPU."""
    loader.default_chunk = None
    return loader


def as_compiled(loader):
    """The loader as it runs on a GPU with compile=True: crop_and_look_up, here run eagerly (no compiler: the
    same values, but the lookup's index is one int64 per value, so only a few images)."""
    loader.compiled = gpu_loader.crop_and_look_up
    loader.table = gpu_loader._lookup_table(loader.norm, loader.dtype)
    return as_on_a_gpu(loader)


@pytest.mark.parametrize("seed, epoch, batch_size, channels_last, way", [
    (0, 0, 16, False, "cpu"), (0, 3, 7, True, "cpu"), (12345, 1, 75, False, "gpu"),
    (2**64 - 10, 9, 32, True, "compiled"), (0, 0, 16, False, "compiled"),
])
def test_every_batched_image_equals_the_per_sample_reference(seed, epoch, batch_size,
                                                             channels_last, way):
    loader = GPULoader(DATA, LABELS, batch_size, seed=seed,
                       channels_last=channels_last)
    if way != "cpu":  # the GPU's way, eager or compiled, or the CPU's
        (as_on_a_gpu if way == "gpu" else as_compiled)(loader)
    loader.set_epoch(epoch)
    seen = 0
    for x, y in loader:
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 32, 32)
        assert x.is_contiguous(memory_format=torch.channels_last
                               if channels_last else torch.contiguous_format)
        for image, index in zip(x, y.tolist()):
            expected = reference_augment(DATA[index], seed, epoch, index)
            assert torch.equal(image, expected), (index, (image - expected).abs().max())
        seen += len(y)
    assert seen == 75


@pytest.mark.parametrize("padding, flip",
                         [(0, False), (0, True), (2, True), (9, False)])
def test_other_paddings_flips_and_a_non_square_layout_first_input(padding, flip):
    """(N, C, H, W) input of 5 x 12 images: no axis can be swapped unnoticed."""
    nhwc = images(20, height=5, width=12, channels=2, seed=1)
    nchw = nhwc.permute(0, 3, 1, 2).contiguous()
    norm = {"mean": (0.5, 0.25), "std": (0.2, 0.4)}
    loader = GPULoader(nchw, torch.arange(20), 6, seed=4, padding=padding, flip=flip,
                       **norm)
    if padding == 2:  # one case the compiled way
        as_compiled(loader)
    loader.set_epoch(2)
    for x, y in loader:
        assert x.shape[1:] == (2, 5, 12)
        for image, index in zip(x, y.tolist()):
            expected = reference_augment(nchw[index], 4, 2, index, padding=padding,
                                         flip=flip, **norm)
            assert torch.equal(image, expected)
            # the reference reads (H, W, C) too
            assert torch.equal(expected, reference_augment(
                nhwc[index].numpy(), 4, 2, index, padding=padding, flip=flip, **norm))
    if padding == 0 and not flip:  # no augmentation: just the normalised images
        x = augment_batch(nhwc, torch.arange(20), 4, 2, padding=0, flip=False, **norm)
        plain = nchw.float().div(255).sub(torch.tensor(norm["mean"]).view(2, 1, 1))
        plain = plain.div(torch.tensor(norm["std"]).view(2, 1, 1))
        # one multiply and one add, x * (1 / (255 std)) + (-mean / std): the same
        # values as (x / 255 - mean) / std up to float32 rounding
        assert torch.allclose(x, plain, rtol=0, atol=1e-6) and not torch.equal(x, plain)


def test_a_batch_gathered_elsewhere_is_augmented_with_its_samples_keys():
    index = torch.tensor([70, 3, 3, 41, 0])
    gathered = DATA[index].contiguous()  # as a DataLoader collates it
    expected = augment_batch(DATA, index, 8, 2, channels_last=True)
    got = augment_batch(gathered, torch.arange(5), 8, 2, keys=index, channels_last=True)
    assert torch.equal(got, expected)
    assert not torch.equal(got, augment_batch(gathered, torch.arange(5), 8, 2))
    for dtype in (torch.float32, torch.bfloat16):  # the reference's bits, rounded to dtype
        low = augment_batch(DATA, index.int(), 8, 2, dtype=dtype)
        assert all(torch.equal(x, reference_augment(DATA[i], 8, 2, i).to(dtype))
                   for x, i in zip(low, index.tolist()))
    with pytest.raises(ValueError, match="one key per index: 4 keys for 5 indices"):
        augment_batch(gathered, torch.arange(5), 8, 2, keys=index[:4])


def test_the_reference_is_torchvisions_crop_with_zero_padding_and_flip():
    """For the same draws, torchvision's functional RandomCrop(32, padding=4) (fill 0),
    hflip, ToTensor and Normalize give the reference's image."""
    from PIL import Image
    from torchvision.transforms import functional as TF

    for index in range(12):
        dy, dx, flipped = sample_draws(7, 1, index)
        pil = TF.crop(TF.pad(Image.fromarray(DATA[index].numpy()), 4, fill=0),
                      dy, dx, 32, 32)
        if flipped:
            pil = TF.hflip(pil)
        expected = TF.normalize(TF.to_tensor(pil), CIFAR_MEAN, CIFAR_STD)
        got = reference_augment(DATA[index], 7, 1, index)
        assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert {sample_draws(7, 1, i)[2] for i in range(12)} == {True, False}


def test_tensor_draws_equal_the_python_integer_draws():
    indices = torch.cat([torch.arange(500), torch.tensor([2**31, 2**32 - 1])])
    for seed, epoch, padding in [(0, 0, 4), (2**64 - 2, 1, 4), (99, 7, 0), (5, 3, 100)]:
        dy, dx, flip = augment_draws(seed, epoch, indices, padding)
        for i, index in enumerate(indices.tolist()):
            assert (int(dy[i]), int(dx[i]), bool(flip[i])) == sample_draws(
                seed, epoch, index, padding)
    # int32 indices give the same draws
    assert all(torch.equal(a, b) for a, b in zip(
        augment_draws(3, 4, indices[:500].int()), augment_draws(3, 4, indices[:500])))


def chi_square(counts):
    counts = np.asarray(counts, dtype=float).ravel()
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_draws_are_evenly_spread_and_unrelated_across_indices_epochs_and_seeds():
    n = 90_000
    dy, dx, flip = augment_draws(0, 0, torch.arange(n))
    dy1, _, flip1 = augment_draws(0, 1, torch.arange(n))
    dys, _, _ = augment_draws(1, 0, torch.arange(n))
    # 99.99th percentiles of chi-square: 8 degrees of freedom 31.8, 80: 130.0
    assert chi_square(torch.bincount(dy, minlength=9)) < 31.8
    assert chi_square(torch.bincount(dx, minlength=9)) < 31.8
    pairs = {"dy, dx of a sample": dy * 9 + dx,
             "dy of neighbouring indices": dy[:-1] * 9 + dy[1:],
             "dy of one index in epochs 0 and 1": dy * 9 + dy1,
             "dy of one index with seeds 0 and 1": dy * 9 + dys}
    for name, joint in pairs.items():
        assert chi_square(torch.bincount(joint, minlength=81)) < 130.0, name
    assert abs(flip.float().mean() - 0.5) < 0.01
    assert abs((flip == flip1).float().mean() - 0.5) < 0.01  # epochs flip independently


@pytest.mark.parametrize(
        "n, replicas, batch_size, drop_last, drop_last_batch, shuffle", [
    (75, 1, 16, False, False, True), (75, 2, 8, False, False, True),
    (75, 4, 5, True, True, True), (75, 3, 10, False, True, False),
    (10, 4, 3, False, False, True), (3, 5, 2, False, False, True),
])
def test_each_rank_gets_exactly_shardsamplers_indices(n, replicas, batch_size,
                                                      drop_last, drop_last_batch,
                                                      shuffle):
    for epoch in (0, 5):
        for rank in range(replicas):
            loader = GPULoader(DATA[:n], LABELS[:n], batch_size, num_replicas=replicas,
                               rank=rank, seed=11, shuffle=shuffle, drop_last=drop_last,
                               drop_last_batch=drop_last_batch)
            sampler = ShardSampler(range(n), replicas, rank, shuffle=shuffle, seed=11,
                                   drop_last=drop_last)
            loader.set_epoch(epoch)
            sampler.set_epoch(epoch)
            expected = list(sampler)
            if drop_last_batch:
                expected = expected[:len(expected) // batch_size * batch_size]
            got = batches(loader)
            assert len(got) == len(loader)
            assert [len(y) for _, y in got[:-1]] == [batch_size] * (len(got) - 1)
            assert torch.cat([y for _, y in got]).tolist() == expected


def test_a_global_batch_is_the_same_images_on_two_ranks_as_on_one():
    one = batches(GPULoader(DATA, LABELS, 20, seed=3, drop_last=True,
                            drop_last_batch=True))
    ranks = [batches(GPULoader(DATA, LABELS, 10, num_replicas=2, rank=r, seed=3,
                               drop_last=True, drop_last_batch=True)) for r in (0, 1)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 75 // 20
    for k, (x, y) in enumerate(one):
        x2 = torch.cat([ranks[0][k][0], ranks[1][k][0]])
        y2 = torch.cat([ranks[0][k][1], ranks[1][k][1]])
        assert sorted(y.tolist()) == sorted(y2.tolist())
        assert torch.equal(x[y.argsort()], x2[y2.argsort()])


def test_a_loader_started_at_any_batch_yields_the_rest_of_the_epoch_exactly():
    full = GPULoader(DATA, LABELS, 8, num_replicas=2, rank=1, seed=5)
    full.set_epoch(0)
    batches(full)  # history that must not matter
    full.set_epoch(3)
    reference = batches(full)
    assert len(reference) == 5
    for start in range(len(reference) + 1):
        # a new loader, as in a restarted process
        resumed = GPULoader(DATA, LABELS, 8, num_replicas=2, rank=1, seed=5)
        resumed.set_epoch(3, start_batch=start)
        got = batches(resumed)
        assert len(got) == len(resumed) == len(reference) - start
        for (x, y), (rx, ry) in zip(got, reference[start:]):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    again = batches(full)  # iterating again repeats the epoch
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, reference))
    full.set_epoch(4)
    assert not torch.equal(batches(full)[0][1], reference[0][1])


def test_the_loop_converts_nothing_to_python(monkeypatch):
    """On CUDA each of these would make the host wait for the GPU."""
    loader = GPULoader(DATA, LABELS, 16, seed=1)
    loader.set_epoch(2)
    expected = batches(loader)

    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} called in the loop")
        return method

    def refuse_but_the_plan(name):  # the host plan reads the permutation, made on the host
        real = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            if inspect.stack()[1].function in ("_indices", "_plan"):
                return real(self, *args, **kwargs)
            raise AssertionError(f"Tensor.{name} called in the loop")
        return method

    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "__float__",
                 "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    monkeypatch.setattr(torch.Tensor, "numpy", refuse_but_the_plan("numpy"))
    got = [(x, y) for x, y in loader]
    monkeypatch.undo()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, expected))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_batches_equal_the_cpu_ones_without_a_host_sync():
    from utils.gpu_check import loader_sync  # what `python -m utils.gpu_check` runs

    result = loader_sync("cuda")
    assert result["passed"] and result["host_syncs_checked"] and result["batches"] == 5, result


def test_the_no_sync_check_compares_with_the_cpu_batches(monkeypatch):
    """The check the GPU machine runs, here on the CPU: equal batches pass; batches of the loader under
    test (the second one it makes) one step off fail it."""
    from utils import gpu_check

    assert gpu_check.loader_sync("cpu")["passed"]
    made, real_init, real_iter = [], GPULoader.__init__, GPULoader.__iter__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def iterate(self):
        for x, y in real_iter(self):
            yield (x + 1e-3 if self is made[1] else x), y

    monkeypatch.setattr(GPULoader, "__init__", init)
    monkeypatch.setattr(GPULoader, "__iter__", iterate)
    result = gpu_check.loader_sync("cpu")
    assert not result["passed"] and not result["batches_equal_cpu"] and result["batches"] == 5


def allocated_peak(run) -> int:
    """The most bytes torch's CPU allocator had lent at once while ``run()`` ran, of what it lent then: every
    allocation and free, those inside an operation's kernel too, as the profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):  # + allocated, - freed
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_allocated_peak_sees_what_kernels_allocate_inside():
    x = torch.zeros(100_000, dtype=torch.uint8)
    # a float32 copy (400 kB), then its bfloat16 copy (200 kB) beside it, the float32 one freed
    assert allocated_peak(lambda: x.float().to(torch.bfloat16)) == 600_000
    # aten::index converts an int32 index to int64 inside its kernel: 800 kB that no operation shows,
    # beside the 100 kB it returns
    index = torch.arange(100_000, dtype=torch.int32)
    assert allocated_peak(lambda: x[index]) == 900_000


@pytest.mark.parametrize("dtype, replicas", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_resident_bytes_is_the_measured_peak_of_a_set_up_and_an_epoch(dtype, replicas):
    """Every byte allocated while a loader is made and an epoch of it runs (set up whole, as on a GPU), at
    its peak: resident_bytes within 10 %. choose_loader sizes the GPU loader by it."""
    data = images(600)

    def make_and_run():
        loader = as_on_a_gpu(GPULoader(data, torch.arange(600), 100, dtype=dtype,
                                       num_replicas=replicas, rank=0))
        for _ in loader:
            pass
        assert loader.data.nbytes == 600 * 40 * 40 * 3  # the 4-pixel border, once
    measured, predicted = allocated_peak(make_and_run), resident_bytes(data, dtype=dtype,
                                                                        num_replicas=replicas)
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)
    assert predicted == resident_bytes(data.numpy(), dtype=dtype, num_replicas=replicas)
    assert "600 images of (32, 32, 3) on cpu" in repr(GPULoader(data, torch.arange(600), 8))


INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
            torch.uint64, torch.bool)  # not uint8: pixels
INDEXING = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_", "index_select",
            "gather", "take", "take_along_dim", "embedding", "scatter", "scatter_", "index_add",
            "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_"}


class IndexLog(TorchDispatchMode):
    """Every integer or bool tensor the operations under it allocate, and every index that an indexing
    operation reads, at the size its indices broadcast to (on CUDA aten::index makes broadcast indices
    contiguous, and int32 ones int64: tensors of that size that no operation here shows)."""

    def __init__(self):
        super().__init__()
        self.made, self.read = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.made += [(name, t.dtype, t.numel()) for t in tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor) and t.dtype in INTEGERS
                      and not func.is_view]  # a view allocates nothing
        if name in INDEXING:
            shapes = [t.shape for t in tree_flatten((args[1:], kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.dtype in INTEGERS]
            self.read.append((name, math.prod(torch.broadcast_shapes(*shapes))))
        return out

    def largest(self) -> tuple[int, int]:
        return (max((n for *_, n in self.made), default=0),
                max((n for _, n in self.read), default=0))


@pytest.mark.parametrize("chunk", ["epoch", "batch"])
def test_no_index_tensor_is_larger_than_one_element_per_image(chunk):
    """The plan's bound, for a chunk of n images (a GPU's whole epoch, or one batch): an index read is
    one element per image (the crops' starts), and an integer or bool tensor made at most the plan's 3
    per image (start, flip, label: its copy on a GPU; the flips' bool here), or the permutation's one
    per image of the data set. Here 96 images, not one per pixel (96 x 8 x 8 x 3) or per row (96 x 8).
    The code before this one read broadcast (n, H, W) indices and made an int32 (n, C, H, W) copy of the
    pixels for its lookup, on a GPU int64 tensors of 8 bytes per pixel. Checked for the loader's set-up
    and first batch, a whole epoch, and augment_batch's batch (bound: the batch)."""
    n, batch = 96, 32
    data = images(n, height=8, width=8)
    loader = GPULoader(data, torch.arange(n), batch, seed=3,
                       chunk_batches=1 if chunk == "batch" else None)
    if chunk == "epoch":
        as_on_a_gpu(loader)
    iterator, first = iter(loader), IndexLog()
    with first:
        next(iterator)
    chunk_images = n if chunk == "epoch" else batch
    made, read = first.largest()
    assert 0 < made <= max(3 * chunk_images, n) and 0 < read <= chunk_images, (first.made, first.read)
    whole = IndexLog()
    with whole:
        batches(loader)
    made, read = whole.largest()
    assert 0 < made <= max(3 * chunk_images, n) and 0 < read <= chunk_images, (whole.made, whole.read)
    one_batch = IndexLog()
    with one_batch:
        augment_batch(data, torch.arange(batch).int(), 0, 0, dtype=torch.bfloat16)
    assert one_batch.largest() == (batch, batch), (one_batch.made, one_batch.read)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"images": DATA.float()}, TypeError, "images must be uint8"),
    ({"images": DATA[0]}, ValueError, "images must be a non-empty 4-D batch"),
    ({"images": DATA[:0], "labels": LABELS[:0]}, ValueError, "non-empty"),
    ({"images": images(4, channels=4), "labels": LABELS[:4]}, ValueError,
     "must be (..., H, W, 3) or (..., 3, H, W)"),
    ({"images": images(4, height=3, width=32), "labels": LABELS[:4]}, ValueError,
     "(4, 3, 32, 3) is ambiguous"),
    ({"images": [[1, 2]]}, TypeError, "images must be a uint8 tensor or NumPy array"),
    ({"labels": LABELS[:-1]}, ValueError, "75 images but 74 labels"),
    ({"labels": LABELS.float()}, TypeError, "labels must be integers"),
    ({"batch_size": 0}, ValueError, "batch_size=0 is out of range"),
    ({"batch_size": 2.5}, TypeError, "batch_size must be an integer"),
    ({"num_replicas": 2, "rank": 2}, ValueError, "rank=2 is out of range for "
                                                 "num_replicas=2"),
    ({"num_replicas": 0, "rank": 0}, ValueError, "num_replicas=0 is out of range"),
    ({"padding": -1}, ValueError, "padding=-1 is out of range"),
    ({"seed": -1}, ValueError, "seed=-1 is out of range"),
    ({"mean": (0.5, 0.5)}, ValueError, "mean and std need one value per channel"),
    ({"std": (1.0, 0.0, 1.0)}, ValueError, "std must be positive"),
    ({"channels_last": 1}, TypeError, "channels_last must be True or False"),
])
def test_bad_arguments_are_refused_with_a_message(kwargs, error, message):
    args = {"images": DATA, "labels": LABELS, "batch_size": 8, **kwargs}
    with pytest.raises(error) as caught:
        GPULoader(args.pop("images"), args.pop("labels"), args.pop("batch_size"),
                  **args)
    assert message in str(caught.value)


def test_bad_epochs_starts_indices_and_data_are_refused_with_a_message():
    loader = GPULoader(DATA, LABELS, 8)  # 10 batches
    with pytest.raises(ValueError, match="start_batch=11 is out of range; "
                                         "expected start_batch <= 10"):
        loader.set_epoch(0, start_batch=11)
    with pytest.raises(ValueError, match="epoch=-1 is out of range"):
        loader.set_epoch(-1)
    with pytest.raises(TypeError, match="indices must be a 1-D int32 or int64 tensor"):
        augment_draws(0, 0, torch.zeros(3))
    with pytest.raises(TypeError, match="must be a contiguous uint8 tensor"):
        augment_batch(DATA.permute(0, 2, 1, 3), torch.arange(3), 0, 0)
    with pytest.raises(ValueError, match="data has 3 channels"):
        augment_batch(DATA, torch.arange(3), 0, 0, mean=(0.5,), std=(0.5,))
    with pytest.raises(TypeError, match="image must be a 3-D uint8 image"):
        reference_augment(DATA[:2], 0, 0, 0)


# --- launches: what a batch and an epoch cost in tensor operations --------------------

@pytest.mark.parametrize("channels_last", [True, False])
def test_an_epoch_costs_8_operations_and_a_batch_two_slices(channels_last):
    """Counted on the CPU; on a GPU each operation but the views is a launch. An epoch's set-up: the
    permutation (on the host, as DistributedSampler's), the gather of the crops, the flips' bool, the flip,
    the where, the float32 copy, the multiply and the add: 8 here, 10 on a GPU, where the plan is pinned
    and copied (a 2-byte dtype adds its conversion). The gather and lookup before this took 6 here, with
    index tensors of 8 bytes per pixel on a GPU; the whole-epoch loader before that 142 operations (views
    included), the per-batch augmentation before it 52 per batch."""
    set_ups = []
    for batches_per_epoch in (3, 12, 40):
        n = 8 * batches_per_epoch
        loader = as_on_a_gpu(GPULoader(images(n), torch.arange(n), 8, channels_last=channels_last))
        counts, kernels = count_ops(loader), count_ops(loader, views=False)
        assert len(counts) == batches_per_epoch and kernels[0] == 8, kernels
        # then two slices a batch; while the first batch trains the next epoch's plan is made (on the
        # host: its one tensor operation is the permutation)
        assert kernels[1:] == [1] + [0] * (batches_per_epoch - 2), kernels
        assert counts[2:] == [2] * (batches_per_epoch - 2), counts
        set_ups.append(counts[0])
    assert len(set(set_ups)) == 1, set_ups  # the same set-up for 3 or 40 batches
    chunked = count_ops(as_on_a_gpu(GPULoader(images(80), torch.arange(80), 8, chunk_batches=4)),
                        views=False)
    assert [c >= 4 for c in chunked] == [k % 4 == 0 for k in range(10)], chunked


def test_count_ops_counts_what_it_should():
    assert count_ops([1, 2]) == [0, 0]

    def two_adds():
        x = torch.zeros(3)
        yield x.add(1)           # zeros + add
        yield x.add(1).add(1)    # two adds
    assert count_ops(two_adds()) == [2, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amp_dtypes_are_the_float32_images_rounded(dtype):
    full = batches(GPULoader(DATA, LABELS, 16, seed=2))
    low = batches(GPULoader(DATA, LABELS, 16, seed=2, dtype=dtype, channels_last=True))
    looked_up = batches(as_compiled(GPULoader(DATA, LABELS, 16, seed=2, dtype=dtype, channels_last=True)))
    for (x, y), (lx, ly), (tx, _) in zip(full, low, looked_up):
        assert torch.equal(tx, lx) and tx.is_contiguous(memory_format=torch.channels_last)
        assert lx.dtype == dtype and torch.equal(y, ly)
        assert lx.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(lx, x.to(dtype))


def test_chunks_give_the_whole_epoch_s_batches_and_resume_exactly():
    whole = GPULoader(DATA, LABELS, 8, seed=6)
    chunked = GPULoader(DATA, LABELS, 8, seed=6, chunk_batches=3)
    for loader in (whole, chunked):
        loader.set_epoch(1, start_batch=2)
    got, expected = batches(chunked), batches(whole)
    assert len(got) == len(expected) == 8
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(got, expected))
    with pytest.raises(ValueError, match="chunk_batches"):
        GPULoader(DATA, LABELS, 8, chunk_batches=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        GPULoader(DATA, LABELS, 8, dtype=torch.int8)


def test_compile_makes_static_sizes_and_no_bounds_check_per_element(monkeypatch):
    """compile=True (run on a GPU only): the sizes static until a length changes (dynamo then recompiles
    with that length alone symbolic), not dynamic=True, which kept every size symbolic; no bounds check
    per element (on the CPU's compiler a TORCH_CHECK per value read, checked by hand)."""
    from utils import devices

    calls = []
    monkeypatch.setattr(gpu_loader, "_COMPILED", [])
    monkeypatch.setattr(devices, "compile_problem", lambda device: None)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    assert gpu_loader._compiled_augmentation(torch.device("cpu"), False) is None
    assert gpu_loader._compiled_augmentation(torch.device("cpu"), True) is gpu_loader.crop_and_look_up
    assert calls == [{"options": {"assert_indirect_indexing": False}}]
