"""A GPU-resident training loader: the whole uint8 data set on the device, augmentation
as whole-batch tensor operations, every random choice keyed by ``(seed, epoch)``.

The training set lives on the device as one uint8 tensor, with its zero border
(``padding``) added once. At the start of each epoch the host makes the epoch's plan
(the order, as ``ShardSampler``'s, and each sample's crop and flip, in NumPy: per
image, where its crop begins in the padded set, whether it is mirrored, its label)
and copies it to the device in one pinned copy. Then this rank's crops are gathered
by one ``index_select`` from a strided view of the padded set in which each crop is
one item (one index per image, none per row or pixel), mirrored by a ``where``, and
normalised as ``reference_augment`` normalises them (a conversion to float32, a
multiply, an add, then the batches' dtype), all at once: at most 11 tensor operations
on a GPU, the permutation and the plan's copy included (``count_ops`` counts them on
the CPU, which has no copy to make), whatever the number of batches, and no host
synchronisation. No index tensor is larger than the plan: none per row or pixel,
made by the loader or inside an operation. Each batch is then two slices of the
result; the next epoch's plan is made while the first batch trains. The same code
runs on CPU tensors, which is how it is tested.

Public names (stable; the benchmark and chapter 14 import them):

- ``GPULoader(images, labels, batch_size, ...)``: the loader. ``set_epoch(epoch,
  start_batch=0)`` then iterate: ``(images, labels)`` batches on the device, float32
  ``(B, C, H, W)`` (``channels_last`` strides if asked) and int64 ``(B,)``.
- ``augment_batch(data, indices, seed, epoch, ..., keys=None)``: the batched
  augmentation of ``data[indices]`` (``data``: ``(N, H, W, C)`` uint8 on any device);
  ``keys`` (default ``indices``) are the sample indices that key the draws, for a
  batch gathered elsewhere.
- ``reference_augment(image, seed, epoch, index, ...)``: the same augmentation for one
  sample, written plainly; the tests compare the two image by image.
- ``augment_draws(seed, epoch, indices, padding)``: the crop offsets and flips of many
  samples, as tensors on ``indices``' device; ``sample_draws(seed, epoch, index,
  padding)``: one sample's, as Python ints (the same values).
- ``resident_bytes(images, padding, dtype, num_replicas)``: the most bytes the
  loader has allocated on its device at once (kept, and at an epoch's set-up), as
  measured (``tests/test_gpu_loader.py`` measures it);
  ``CIFAR_MEAN``, ``CIFAR_STD``: the default normalisation.

Where each random choice comes from:

- The order is ``ShardSampler``'s: a permutation drawn on the CPU from the generator
  seeded with ``seed + epoch`` (as ``DistributedSampler`` does; a CUDA generator
  would give another permutation), padded or cut and strided by rank, copied to the
  device once per epoch. With ``batch_size`` per rank, batch ``k`` of all ranks
  together covers positions ``[k*b*R, (k+1)*b*R)`` of the epoch's order.
- The crop offsets and the flip of sample ``index`` in ``epoch`` are a hash of
  ``(seed, epoch, index)``, computed with exact 64-bit integer operations (by the
  loader in NumPy on the host, by ``augment_batch`` and ``augment_draws`` with tensor
  operations on the data's device: the same values everywhere): no generator, no
  state, no dependence on the
  batch size, the rank or what ran before. A run resumed mid-epoch
  (``set_epoch(epoch, start_batch=k)``) yields exactly the batches an uninterrupted run
  yields from batch ``k`` on.

These draws differ from ``utils.train_cifar10.KeyedAugment``'s (one torch generator per
sample, too slow for a whole epoch at GPU speed): the two loaders give the same
distribution of augmentations but not the same images.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode

from ._checks import check_bool, check_int, check_rank
from .samplers import MAX_SEED, check_labels, check_seed_and_epoch, epoch_generator
from .seeding import derive_seed

__all__ = ["GPULoader", "augment_batch", "reference_augment", "augment_draws",
           "sample_draws", "resident_bytes", "count_ops", "CIFAR_MEAN", "CIFAR_STD"]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

_M32 = 0xFFFFFFFF
# lowbias32 (C. Wellons, hash-prospector): a bijection of 32-bit integers
_C1, _C2 = 0x7FEB352D, 0x846CA68B
_STREAM = 0x9E3779B9  # separates the three draws of a sample: dy, dx, flip
_TAG = 0x6770755F6C6F6164  # "gpu_load": these keys differ from other derive_seed uses
MAX_PADDING = 2**20
CPU_CHUNK_IMAGES = 256  # GPULoader on the CPU: images augmented at a time


# --- the draws: a hash of (seed, epoch, index) ----------------------------------------

def _epoch_key(seed: int, epoch: int) -> tuple[int, int]:
    """Two 32-bit keys for ``(seed, epoch)``, mixed once per epoch on the host."""
    seed, epoch = check_seed_and_epoch(seed, epoch)
    key = derive_seed(seed, epoch, _TAG)
    return key & _M32, key >> 32


def _mix_int(x: int) -> int:
    """lowbias32 on a Python int in ``[0, 2**32)``."""
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _mix_np(x: np.ndarray) -> np.ndarray:
    """lowbias32 on a uint64 array of values in ``[0, 2**32)`` (the products fit in
    64 bits)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, without overflowing int64
    (``c`` is split into 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of values in ``[0, 2**32)``: exact on any device."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _check_padding(padding) -> int:
    return check_int("padding", padding, minimum=0, maximum=MAX_PADDING)


def sample_draws(seed: int, epoch: int, index: int,
                 padding: int = 4) -> tuple[int, int, bool]:
    """``(dy, dx, flip)`` of sample ``index`` in ``epoch``, computed with Python ints.

    ``dy`` and ``dx`` are the crop's top-left corner in the padded image, each in
    ``[0, 2 * padding]``; ``flip`` is whether the crop is mirrored left to right.
    """
    index = check_int("index", index, minimum=0, maximum=_M32)
    span = 2 * _check_padding(padding) + 1
    k0, k1 = _epoch_key(seed, epoch)
    base = _mix_int(_mix_int(index ^ k0) ^ k1)
    h = [_mix_int(base ^ ((j * _STREAM) & _M32)) for j in range(3)]
    return (h[0] * span) >> 32, (h[1] * span) >> 32, bool(h[2] >> 31)


def _draws(keys: tuple[int, int], indices: torch.Tensor,
           span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sample_draws`` for every index at once, with tensor operations."""
    k0, k1 = keys
    base = _mix(_mix(indices.to(torch.int64) ^ k0) ^ k1)
    h = [_mix(base ^ ((j * _STREAM) & _M32)) for j in range(3)]
    return (h[0] * span) >> 32, (h[1] * span) >> 32, (h[2] >> 31).bool()


def _draws_np(keys: tuple[int, int], indices: np.ndarray,
              span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_draws`` on the host, with NumPy: the same values, and no tensor operation."""
    k0, k1 = (np.uint64(k) for k in keys)
    base = _mix_np(_mix_np(indices.astype(np.uint64) ^ k0) ^ k1)
    h = [_mix_np(base ^ np.uint64((j * _STREAM) & _M32)) for j in range(3)]
    span = np.uint64(span)
    return ((h[0] * span) >> np.uint64(32)).astype(np.int64), \
        ((h[1] * span) >> np.uint64(32)).astype(np.int64), (h[2] >> np.uint64(31)) == 1


def augment_draws(seed: int, epoch: int, indices,
                  padding: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dy, dx, flip)`` of every sample in ``indices`` (int64, int64, bool tensors on
    ``indices``' device): the values ``sample_draws`` gives one by one."""
    indices = _check_indices(indices)
    return _draws(_epoch_key(seed, epoch), indices, 2 * _check_padding(padding) + 1)


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``; a CPU tensor bound for a GPU goes through pinned memory, so
    that the copy does not make the host wait."""
    if x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def _check_indices(indices) -> torch.Tensor:
    indices = torch.as_tensor(indices)
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be a 1-D int32 or int64 tensor, got shape "
                        f"{tuple(indices.shape)} and dtype {indices.dtype}")
    return indices


# --- the augmentation: one sample plainly, a batch with tensor ops --------------------

def _check_norm(mean, std) -> tuple[tuple[float, ...], tuple[float, ...]]:
    mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
    if not mean or len(mean) != len(std):
        raise ValueError(f"mean and std need one value per channel and the same "
                         f"length, got {len(mean)} and {len(std)}")
    if not all(s > 0 for s in std):
        raise ValueError(f"std must be positive, got {std}")
    return mean, std


def _channel_dim(shape: tuple[int, ...], channels: int, what: str) -> bool:
    """True if the channels are last in ``shape`` (``(..., H, W, C)``), False if they
    come first (``(..., C, H, W)``); an error otherwise."""
    last, first = shape[-1] == channels, shape[-3] == channels
    if last and first:
        raise ValueError(f"{what} of shape {shape} is ambiguous: both its channel "
                         f"dimensions could be the {channels} channels; pass "
                         f"(..., H, W, C) with H != {channels}")
    if not (last or first):
        raise ValueError(f"{what} must be (..., H, W, {channels}) or "
                         f"(..., {channels}, H, W) for {channels} channels "
                         f"(one per mean/std value), got shape {shape}")
    return last


def reference_augment(image, seed: int, epoch: int, index: int, *, padding: int = 4,
                      flip: bool = True, mean: Sequence[float] = CIFAR_MEAN,
                      std: Sequence[float] = CIFAR_STD) -> torch.Tensor:
    """Sample ``index``'s augmented image in ``epoch``, one sample written plainly:
    pad with zeros, crop, maybe flip, divide by 255, normalise.

    ``image``: uint8 ``(H, W, C)`` or ``(C, H, W)`` (array or tensor). Returns float32
    ``(C, H, W)`` on the image's device.
    """
    mean, std = _check_norm(mean, std)
    image = torch.as_tensor(image)
    if image.dtype != torch.uint8 or image.dim() != 3:
        raise TypeError(f"image must be a 3-D uint8 image, got shape "
                        f"{tuple(image.shape)} and dtype {image.dtype}")
    if _channel_dim(tuple(image.shape), len(mean), "image"):
        image = image.permute(2, 0, 1)
    _, height, width = image.shape
    dy, dx, flipped = sample_draws(seed, epoch, index, padding)
    padded = F.pad(image, (padding, padding, padding, padding))  # zeros
    crop = padded[:, dy:dy + height, dx:dx + width]
    if flip and flipped:
        crop = crop.flip(2)
    scale, shift = _norm_constants(mean, std, crop.device)
    return crop.float().mul(scale[0]).add(shift[0])  # x / 255 - mean, over std


def _windows(padded: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Every ``height x width`` crop of the padded images ``padded`` (contiguous uint8
    ``(N, H + 2p, W + 2p, C)``) as one item of a strided view ``(S, height, width *
    C)``: item ``s`` is the crop whose top-left pixel is pixel ``s`` of the images laid
    end to end, its rows ``W + 2p`` pixels apart. A view, not a copy: gathering ``n``
    crops takes ``n`` indices, one per image. (Items that straddle two images exist,
    and no plan asks for them.)"""
    n, padded_height, padded_width, channels = padded.shape
    count = n * padded_height * padded_width - (height - 1) * padded_width - width + 1
    return padded.as_strided((count, height, width * channels),
                             (channels, padded_width * channels, 1))


def _crop_flip_normalise(windows: torch.Tensor, starts: torch.Tensor, flipped,
                         norm: tuple[torch.Tensor, torch.Tensor], channels_last: bool,
                         dtype: torch.dtype) -> torch.Tensor:
    """The crops ``windows[starts]`` (``_windows``; ``starts``: one int64 per image),
    mirrored where ``flipped`` (bool, one per image; ``None``: none), normalised as
    ``reference_augment`` normalises: ``(n, C, H, W)`` in ``dtype``.

    One ``index_select`` gathers the crops (the only index: ``starts``), ``flip`` and
    ``where`` mirror them, a conversion to float32, a multiply and an add normalise
    (two roundings, as ``reference_augment``'s: the same bits on any device), and a
    conversion makes ``dtype``. With ``P`` the crops' uint8 bytes, at most ``5 P``
    (float32) or ``6 P`` (2-byte dtypes) are allocated at once: ``resident_bytes``."""
    scale, shift = norm
    n, (_, height, row), channels = starts.shape[0], windows.shape, scale.numel()
    x = windows.index_select(0, starts).view(n, height, row // channels, channels)
    if flipped is not None:  # whole crops mirrored: no index per pixel
        x = torch.where(flipped.view(n, 1, 1, 1), x.flip(2), x)
    # (n, H, W, C) seen as (n, C, H, W) is channels_last memory already
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = x.permute(0, 3, 1, 2).to(torch.float32, memory_format=layout)
    x = x.mul_(scale).add_(shift)
    return x if dtype == torch.float32 else x.to(dtype)


_NORM_CACHE: dict = {}


def _norm_constants(mean, std, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, shift)``, float32 ``(1, C, 1, 1)`` on ``device``, with
    ``x * scale + shift == (x / 255 - mean) / std``: made once per device and values,
    so that no later call copies from the host (on CUDA a copy from pageable memory
    would make the host wait)."""
    mean, std = _check_norm(mean, std)
    key = (mean, std, torch.device(device))
    if key not in _NORM_CACHE:
        scale = [1.0 / (255.0 * s) for s in std]
        shift = [-m / s for m, s in zip(mean, std)]
        both = torch.tensor([scale, shift], dtype=torch.float32).to(device)
        _NORM_CACHE[key] = (both[0].view(1, -1, 1, 1), both[1].view(1, -1, 1, 1))
    return _NORM_CACHE[key]


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtype(dtype) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in DTYPES]} (float32, "
                         f"or the AMP dtype the model computes in), got {dtype!r}")
    return dtype


def augment_batch(data: torch.Tensor, indices, seed: int, epoch: int, *,
                  padding: int = 4, flip: bool = True,
                  mean: Sequence[float] = CIFAR_MEAN,
                  std: Sequence[float] = CIFAR_STD,
                  channels_last: bool = False, keys=None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data[indices]`` augmented as ``reference_augment`` augments each sample.

    ``data``: uint8 ``(N, H, W, C)`` on any device (the loader's resident layout);
    ``indices``: 1-D integer tensor. The draws of ``data[indices[i]]`` are keyed by
    ``(seed, epoch, keys[i])``; ``keys`` defaults to ``indices``, and is for a batch
    gathered elsewhere (a DataLoader's): ``augment_batch(batch, arange(B), seed,
    epoch, keys=its_indices)``. Returns ``(B, C, H, W)`` in ``dtype`` (float32, or
    bfloat16/float16 for AMP: the float32 result rounded), with ``channels_last``
    strides if asked. ``indices`` and ``keys`` are used where they are: pass them on
    ``data``'s device (a CPU tensor is copied there, which on CUDA waits for the copy).
    What it allocates is bounded by the batch: its images padded, its crops, and one
    index per image (no index per pixel).
    """
    if (not isinstance(data, torch.Tensor) or data.dtype != torch.uint8
            or data.dim() != 4 or not data.is_contiguous()):
        raise TypeError("data must be a contiguous uint8 tensor (N, H, W, C), got "
                        + (f"shape {tuple(data.shape)}, dtype {data.dtype}, "
                           f"contiguous={data.is_contiguous()}"
                           if isinstance(data, torch.Tensor)
                           else type(data).__name__))
    indices = _to_device(_check_indices(indices), data.device)
    padding, flip = _check_padding(padding), check_bool("flip", flip)
    norm = _norm_constants(mean, std, data.device)
    if norm[0].numel() != data.shape[3]:
        raise ValueError(f"data has {data.shape[3]} channels (last dimension) but "
                         f"mean and std have {norm[0].numel()} values")
    keys = indices if keys is None else _to_device(_check_indices(keys), data.device)
    if keys.shape != indices.shape:
        raise ValueError(f"keys must have one key per index: {len(keys)} keys for "
                         f"{len(indices)} indices")
    channels_last = check_bool("channels_last", channels_last)
    dtype = _check_dtype(dtype)
    dy, dx, flipped = _draws(_epoch_key(seed, epoch), keys, 2 * padding + 1)
    # this batch's images with their zero border: its crops are then plain items
    padded = F.pad(data.index_select(0, indices), (0, 0) + (padding,) * 4)
    n, padded_height, padded_width, _ = padded.shape
    starts = torch.arange(n, device=data.device) * (padded_height * padded_width)
    starts += dy * padded_width + dx  # each crop's top-left pixel
    windows = _windows(padded, data.shape[1], data.shape[2])
    return _crop_flip_normalise(windows, starts, flipped if flip else None, norm,
                                channels_last, dtype)


def _lookup_table(norm: tuple[torch.Tensor, torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """``(C, 256)`` on ``norm``'s device: every normalised value of each channel,
    computed as ``reference_augment`` computes it (float32, a multiply then an add,
    rounded to ``dtype``), so that a lookup gives the same bits."""
    scale, shift = (t.reshape(-1, 1) for t in norm)
    values = torch.arange(256, dtype=torch.float32, device=scale.device)
    return values.mul(scale).add(shift).to(dtype)


def crop_and_look_up(windows: torch.Tensor, table: torch.Tensor, starts: torch.Tensor,
                     flipped, channels_last: bool) -> torch.Tensor:
    """The GPU loader's augmentation under ``compile=True``: the crops
    ``windows[starts]`` (``_windows``), mirrored where ``flipped`` (bool, one per
    image; ``None``: none), each value ``v`` of channel ``c`` replaced by ``table[c,
    v]`` (``_lookup_table``): ``(n, C, H, W)`` in the table's dtype.

    Written for ``torch.compile``, which makes it one kernel that reads each crop's
    pixels once and writes the batches once, the lookup's indices in registers. Run
    eagerly (as the tests do, on a few images) the lookup's index is a tensor of one
    int64 per value, 8 bytes for each byte of pixels: the eager loader normalises by
    arithmetic instead (``_crop_flip_normalise``)."""
    channels = table.shape[0]
    n, (_, height, row) = starts.shape[0], windows.shape
    pixels = windows.index_select(0, starts).view(n, height, row // channels, channels)
    if flipped is not None:
        pixels = torch.where(flipped.view(n, 1, 1, 1), pixels.flip(2), pixels)
    channel = torch.arange(channels, device=table.device)
    if channels_last:  # (n, H, W, C) seen as (n, C, H, W): channels_last
        return table[channel, pixels.int()].permute(0, 3, 1, 2)
    # the conversion writes (n, C, H, W) in order, and the lookup follows its layout
    return table[channel[:, None, None], pixels.permute(0, 3, 1, 2).to(
        torch.int32, memory_format=torch.contiguous_format)]


_COMPILED: list = []  # torch.compile(crop_and_look_up), made once per process


def _compiled_augmentation(device: torch.device, compile: bool):
    """``crop_and_look_up`` compiled into one kernel with ``compile``, else ``None``
    (eager); where ``torch.compile`` cannot work (``utils.devices.compile_problem``) an
    error says why."""
    from .devices import compile_problem

    if not check_bool("compile", compile):
        return None
    problem = compile_problem(device)
    if problem is not None:
        raise ValueError(f"compile=True, but {problem}")
    if not _COMPILED:
        # sizes static at first: dynamo's automatic dynamic shapes recompile once, with
        # the number of images alone symbolic, for an epoch of another length (resumed,
        # or a last chunk). No bounds check per element: every start is in range by
        # construction (the plan's, from checked draws), and a table index is a uint8.
        _COMPILED.append(torch.compile(crop_and_look_up,
                                       options={"assert_indirect_indexing": False}))
    return _COMPILED[0]


# --- the loader -----------------------------------------------------------------------

def _as_nhwc(images, channels: int) -> torch.Tensor:
    """The images as a uint8 tensor ``(N, H, W, C)`` (a view when they already are)."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a uint8 tensor or NumPy array, "
                        f"got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise TypeError(f"images must be uint8 (0-255 pixels), got {images.dtype}")
    if images.dim() != 4 or images.shape[0] == 0:
        raise ValueError(f"images must be a non-empty 4-D batch (N, H, W, C) or "
                         f"(N, C, H, W), got shape {tuple(images.shape)}")
    if images.shape[0] > _M32:
        raise ValueError(f"at most 2**32 images, got {images.shape[0]}")
    if not _channel_dim(tuple(images.shape), channels, "images"):
        images = images.permute(0, 2, 3, 1)
    return images


def resident_bytes(images, padding: int = 4, dtype: torch.dtype = torch.float32,
                   num_replicas: int = 1) -> int:
    """The most bytes a ``GPULoader`` of ``images`` (``(N, H, W, C)``; an array of that
    shape is enough) has allocated on its device at once, with each epoch set up whole
    (a GPU's default): the uint8 images with their ``padding`` border, kept; and while
    an epoch is set up, for this rank's ``n = N / num_replicas`` images, whose crops
    are ``P = n H W C`` bytes of uint8, the plan on the device (3 int64 and a bool per
    image) and the most the set-up holds at once: the crops beside their float32 copy
    (``5 P``) or, for a 2-byte ``dtype``, that copy beside the batches (``6 P``).

    ``tests/test_gpu_loader.py`` checks it against every allocation of a real set-up
    and epoch, measured on the CPU (the same operations, the same tensors), within
    10 %. The batches (``4 P``, or ``2 P``) stay until the epoch's last batch is let go:
    a batch of one epoch still held while the next is set up adds them. ``compile=True``
    allocates less (the plan and the batches)."""
    n, height, width, channels = (int(d) for d in images.shape)
    padding = _check_padding(padding)
    kept = n * (height + 2 * padding) * (width + 2 * padding) * channels
    mine = -(-n // check_int("num_replicas", num_replicas, minimum=1))
    pixels = mine * height * width * channels
    itemsize = _check_dtype(dtype).itemsize
    # the uint8 crops, or the batches in a 2-byte dtype, beside the float32 copy
    return kept + mine * (3 * 8 + 1) + pixels * (4 + (1 if itemsize == 4 else itemsize))


def _resolve_world(num_replicas, rank) -> tuple[int, int]:
    """As ``ShardSampler``, but one process without a process group."""
    group = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if group else 1
    if rank is None:
        rank = dist.get_rank() if group else 0
    num_replicas = check_int("num_replicas", num_replicas, minimum=1)
    return num_replicas, check_rank(rank, num_replicas)


class GPULoader:
    """This rank's augmented training batches, from a data set held on ``device``.

    ``images``: uint8 ``(N, H, W, C)`` or ``(N, C, H, W)``, a tensor or a NumPy array;
    ``labels``: ``N`` integers. ``num_replicas``, ``rank``, ``shuffle``, ``seed`` and
    ``drop_last`` mean what they mean for ``ShardSampler`` (this rank gets exactly its
    indices; ``num_replicas``/``rank`` default to the process group's, or 1/0 without
    one); ``drop_last_batch`` drops this rank's last, incomplete batch, as
    ``DataLoader(drop_last=True)``. ``padding=0, flip=False`` turns augmentation off.
    ``device`` defaults to the images' (the CPU for an array). ``dtype``: the batches'
    float type (float32, or the AMP dtype: bfloat16, float16).

    The images are kept with their zero border (``padding``) already added. Each
    epoch's order and draws are a plan made on the host (NumPy: no tensor operation
    but the permutation): per image, where its crop begins in the padded set, whether
    it is mirrored, and its label, copied to the device at once (pinned, no wait).
    Then augmenting the rest of the epoch takes a fixed number of tensor operations
    whatever its length (``_crop_flip_normalise``: one ``index_select`` of the crops,
    with one index per image, a ``flip`` and a ``where`` for the mirrored ones, a
    conversion to float32, a multiply and an add, and the conversion to ``dtype``),
    and each batch is two slices of the result, no kernel. The next epoch's plan is
    made while the first batch of this one trains. That costs ``resident_bytes`` on
    the device; ``chunk_batches=k`` makes ``k`` batches at a time, for the same
    batches (the default: the whole epoch on a GPU, ``CPU_CHUNK_IMAGES`` images at a
    time on the CPU, where the pixels then stay in the cache and the first batch comes
    at once). ``compile=True``: on a GPU the gather, the flip and the normalisation,
    by a lookup in a ``(C, 256)`` table of the normalised values in ``dtype``, become
    one kernel (``crop_and_look_up``, ``torch.compile``; the first epoch then waits for
    the compilation, once per process and layout).
    """

    def __init__(self, images, labels, batch_size: int, *,
                 num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 drop_last_batch: bool = False, padding: int = 4, flip: bool = True,
                 mean: Sequence[float] = CIFAR_MEAN, std: Sequence[float] = CIFAR_STD,
                 channels_last: bool = False, device=None,
                 dtype: torch.dtype = torch.float32,
                 chunk_batches: int | None = None,
                 compile: bool = False) -> None:
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.num_replicas, self.rank = _resolve_world(num_replicas, rank)
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed, _ = check_seed_and_epoch(seed, 0)
        self.drop_last = check_bool("drop_last", drop_last)
        self.drop_last_batch = check_bool("drop_last_batch", drop_last_batch)
        self.padding, self.flip = _check_padding(padding), check_bool("flip", flip)
        self.channels_last = check_bool("channels_last", channels_last)
        mean, std = _check_norm(mean, std)
        nhwc = _as_nhwc(images, len(mean))
        targets = check_labels(labels)
        if len(targets) != len(nhwc):
            raise ValueError(f"{len(nhwc)} images but {len(targets)} labels")
        if device is None:
            device = nhwc.device
        self.device = torch.device(device)
        p = self.padding
        # the images with their zero border, once: a crop is then a plain gather
        self.data = F.pad(nhwc.to(self.device), (0, 0, p, p, p, p)).contiguous()
        self.height, self.width = nhwc.shape[1], nhwc.shape[2]
        self.labels = targets.astype(np.int64)  # on the host: they travel with the plan
        # each crop one item of a view of the padded set: one index per image
        self.windows = _windows(self.data, self.height, self.width)
        self.dtype = _check_dtype(dtype)
        self.norm = _norm_constants(mean, std, self.device)
        compiled = _compiled_augmentation(self.device, compile)  # checked anywhere
        cuda = self.device.type == "cuda"
        # on a GPU, compile=True normalises by a lookup: one kernel, the same bits
        self.compiled = compiled if cuda else None
        self.table = (_lookup_table(self.norm, self.dtype)
                      if self.compiled is not None else None)
        # batches augmented at a time by default (None: the whole epoch, on a GPU)
        self.default_chunk = (None if cuda
                              else max(1, CPU_CHUNK_IMAGES // self.batch_size))
        self.chunk_batches = (None if chunk_batches is None else
                              check_int("chunk_batches", chunk_batches, minimum=1))
        self._next_plan = None  # ((epoch, start_batch), plan) made ahead
        self.dataset_len = len(nhwc)
        n, r, b = self.dataset_len, self.num_replicas, self.batch_size
        self.num_samples = n // r if self.drop_last else -(-n // r)  # ShardSampler's
        self.num_batches = (self.num_samples // b if self.drop_last_batch
                            else -(-self.num_samples // b))
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Iterate over ``epoch``'s batches from batch ``start_batch`` (0: the whole
        epoch; ``k``: resume after ``k`` batches of this rank)."""
        _, self.epoch = check_seed_and_epoch(self.seed, epoch)
        self.start_batch = check_int("start_batch", start_batch, minimum=0,
                                     maximum=self.num_batches)

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch (all of them, on the CPU):
        ``ShardSampler``'s."""
        return torch.from_numpy(self._indices(self.epoch))

    def _indices(self, epoch: int) -> np.ndarray:
        """``shard_indices`` with one tensor operation (the permutation, which must be
        torch's), the padding or cut and the stride in NumPy."""
        n, r = self.dataset_len, self.num_replicas
        order = (torch.randperm(n, generator=epoch_generator(self.seed, epoch)).numpy()
                 if self.shuffle else np.arange(n, dtype=np.int64))
        total = n // r * r if self.drop_last else -(-n // r) * r
        return np.resize(order, total)[self.rank::r]  # resize repeats from the start

    def _plan(self, epoch: int, start_batch: int) -> torch.Tensor:
        """The plan of ``epoch`` from batch ``start_batch``, on the host: an int64
        ``(3, n)`` tensor of each image's crop start (its top-left pixel in the padded
        images laid end to end: an item of ``self.windows``), flip (1: mirrored) and
        label, pinned when it goes to a GPU."""
        b, p = self.batch_size, self.padding
        order = self._indices(epoch)[start_batch * b:self.num_batches * b]
        dy, dx, flipped = _draws_np(_epoch_key(self.seed, epoch), order, 2 * p + 1)
        padded_width = self.width + 2 * p
        start = (order * (self.height + 2 * p) + dy) * padded_width + dx
        plan = np.stack([start, flipped & self.flip, self.labels[order]])
        if self.device.type != "cuda":
            return torch.from_numpy(plan)
        pinned = torch.empty(plan.shape, dtype=torch.int64, pin_memory=True)
        pinned.numpy()[:] = plan
        return pinned

    def __len__(self) -> int:
        """Batches the next iteration yields (from ``start_batch``)."""
        return self.num_batches - self.start_batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        b, key = self.batch_size, (self.epoch, self.start_batch)
        ahead, self._next_plan = self._next_plan, None
        plan = ahead[1] if ahead is not None and ahead[0] == key else self._plan(*key)
        # on a GPU: from pinned memory, no host wait
        plan = plan.to(self.device, non_blocking=True)
        chunk = self.chunk_batches or self.default_chunk or max(len(self), 1)
        for begin in range(0, plan.shape[1], chunk * b):
            starts, flipped, labels = plan[:, begin:begin + chunk * b]
            images = self._augment(starts, flipped)
            for start in range(0, len(starts), b):  # slices: views, no kernel
                yield images[start:start + b], labels[start:start + b]
                if self._next_plan is None and self.seed + key[0] < MAX_SEED:
                    # the next epoch's plan, on the host, while this batch trains
                    self._next_plan = ((key[0] + 1, 0), self._plan(key[0] + 1, 0))

    def _augment(self, starts: torch.Tensor, flipped: torch.Tensor) -> torch.Tensor:
        """The crops starting at ``starts`` (items of ``self.windows``), mirrored where
        ``flipped`` is 1, normalised: ``(n, C, H, W)`` in ``self.dtype``."""
        mirrored = flipped.bool() if self.flip else None
        if self.compiled is not None:
            return self.compiled(self.windows, self.table, starts, mirrored,
                                 self.channels_last)
        return _crop_flip_normalise(self.windows, starts, mirrored, self.norm,
                                    self.channels_last, self.dtype)

    def __repr__(self) -> str:
        return (f"GPULoader({self.dataset_len} images of "
                f"{(self.height, self.width, self.data.shape[3])} on {self.device}, "
                f"batch_size={self.batch_size}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, seed={self.seed}, epoch={self.epoch})")


# --- counting the tensor operations a loader issues ----------------------------------

class _OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active: on a GPU each one is
    at least a launch's worth of host time (or a metadata-only view)."""

    def __init__(self, views: bool = True):
        super().__init__()
        self.count, self.views = 0, views

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.views or not func.is_view
        return func(*args, **(kwargs or {}))


def count_ops(batches, views: bool = True) -> list[int]:
    """The ATen operations it takes to get each item of ``batches`` (any iterable: a
    ``GPULoader``, a DataLoader): ``counts[0]`` includes what the iteration does
    before its first item (the epoch's set-up). Counted on whatever device the work
    runs on; a CPU run counts what a CUDA run would launch. ``views=False`` leaves out
    the operations that only make a view (a slice, a permute: no kernel)."""
    counts, iterator = [], iter(batches)
    while True:
        counter = _OpCounter(views)
        with counter:
            try:
                next(iterator)
            except StopIteration:
                return counts
        counts.append(counter.count)
