"""utils.loader_bench: the augmentation after the DataLoader is torchvision's, the
prefetcher keeps the order, a small --quick run writes the results file the chapter
reads, and bad arguments are refused with a message."""

import json

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import DataLoader

from utils import gpu_loader
from utils.loader_bench import (CIFAR_MEAN, CIFAR_STD, UInt8Images,
                                augment_loaded_batch, format_table, main,
                                prefetch_to_device, stage_times)


def test_augmentation_after_the_loader_is_torchvisions_at_the_same_draws():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    loader = DataLoader(UInt8Images(data, list(range(40))), batch_size=16,
                        shuffle=True, generator=torch.Generator().manual_seed(0))
    seed, epoch, checked = 3, 5, 0
    for images, labels, indices in loader:
        out = augment_loaded_batch(images, indices, seed, epoch)
        assert out.shape == (len(images), 3, 32, 32) and out.dtype == torch.float32
        # the same values as the resident loader's augmentation of those indices
        assert torch.equal(out, gpu_loader.augment_batch(torch.from_numpy(data),
                                                         indices, seed, epoch))
        for k, index in enumerate(indices.tolist()):
            dy, dx, flip = gpu_loader.sample_draws(seed, epoch, index)
            image = TF.crop(TF.pad(Image.fromarray(data[index]), 4), dy, dx, 32, 32)
            if flip:
                image = TF.hflip(image)
            expected = TF.normalize(TF.to_tensor(image), CIFAR_MEAN, CIFAR_STD)
            assert torch.allclose(out[k], expected, atol=1e-5), index
            assert labels[k] == index
            checked += 1
    assert checked == 40


def test_uint8_images_refuses_other_layouts():
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\)"):
        UInt8Images(np.zeros((2, 3, 32, 32), np.uint8), [0, 1])
    with pytest.raises(ValueError, match="float32"):
        UInt8Images(np.zeros((2, 32, 32, 3), np.float32), [0, 1])


def test_prefetch_to_device_keeps_the_order_and_iterates_once():
    class Counted:
        def __init__(self):
            self.iterations = 0
            self.batches = [(torch.full((2, 3), i), torch.tensor([i, i]))
                            for i in range(5)]

        def __iter__(self):
            self.iterations += 1
            return iter(self.batches)

    source = Counted()
    got = list(prefetch_to_device(source, "cpu"))
    assert source.iterations == 1
    assert len(got) == 5
    assert all(torch.equal(x, s[0]) and torch.equal(y, s[1])
               for (x, y), s in zip(got, source.batches))


def test_stage_times_measures_every_cpu_stage():
    data = np.zeros((8, 32, 32, 3), np.uint8)
    times = stage_times(data, samples=32, batch_size=16, repeats=1)
    assert set(times) == {"decode", "pil_ops", "to_tensor", "normalize", "collate"}
    assert all(t > 0 for t in times.values())


def test_quick_run_writes_the_results_file(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["--quick", "--workers", "0,1", "--n-train", "512", "--pass-images", "512",
          "--repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert {"cpu", "cpu_count", "gpu", "torch", "torchvision", "python", "command",
            "date"} <= set(meta)
    assert meta["command"].startswith("python -m utils.bench loader --quick")
    assert meta["data"]["synthetic"] is True and meta["data"]["train_images"] == 512
    methods = {r["method"] for r in result["results"]}
    assert {"pil_dataloader", "tensor_aug_dataloader", "resident_pipeline"} <= methods
    for r in result["results"]:
        assert {"method", "device", "num_workers", "batch_size", "images_per_s",
                "ratio_to_best_dataloader", "first_batch_s", "main_cpu_s",
                "images_per_main_cpu_s"} <= set(r)
        assert r["images_per_s"] > 0 and r["ratio_to_best_dataloader"] > 0
        assert len(r["pass_s"]) == r["warmup_passes"] + 1
    pil = [r for r in result["results"] if r["method"] == "pil_dataloader"]
    assert max(r["ratio_to_best_dataloader"] for r in pil) == 1.0
    assert {r["num_workers"] for r in pil} == {0, 1}
    assert {r["persistent_workers"] for r in pil if r["num_workers"]} == {True, False}
    target = result["targets"]["cpu_tensor_aug_vs_pil_per_core"]
    assert target["ratio"] > 0 and target["ratio_wall_clock"] > 0
    assert set(result["stages_us_per_sample"]) >= {"decode", "pil_ops", "collate"}
    assert result["floors"]["cpu_copy_bytes_per_s"] > 0
    if not torch.cuda.is_available():
        assert [s["pin_memory"] for s in result["skipped"]] == [True]
        assert "cuda" not in {r["device"] for r in result["results"]}
    assert "one core each" in printed and f"saved {out}" in printed
    assert printed.splitlines()[-4:] == (format_table(result).splitlines()[-3:]
                                         + [f"saved {out}"])


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--workers", "two"], "worker counts separated by commas"),
    (["--workers", "-1"], "worker counts must be >= 0"),
    (["--workers", "1,2"], "must include 0"),
    (["--batch-size", "64", "--pass-images", "100"], "not a multiple of batch_size"),
    (["--n-train", "100", "--pass-images", "512"], "more than the data set"),
    (["--data", "/nonexistent/folder"], "no cifar-10-batches-py folder"),
    (["--device", "tpu"], "invalid choice"),
])
def test_bad_arguments_get_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--quick"] + argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--device", "cuda"])
    assert "no CUDA device" in capsys.readouterr().err


def test_the_host_batches_of_the_cuda_cases_come_from_a_cifar_folder_as_it_is_loaded(tmp_path):
    """The CUDA cases' source, built on the CPU: CIFAR's rows viewed as (N, H, W, C) are not contiguous
    (the first GPU run of the benchmark stopped there: augment_batch refused them)."""
    from utils.data import write_synthetic_cifar10
    from utils.loader_bench import cifar10_pil, host_batches

    write_synthetic_cifar10(str(tmp_path), n_train=40, n_test=1, seed=0)
    pil_set = cifar10_pil(str(tmp_path))
    assert not pil_set.data.flags["C_CONTIGUOUS"]  # the layout that failed
    batches = host_batches(pil_set, 16, 32)
    assert [tuple(x.shape) for x, _ in batches] == [(16, 3, 32, 32)] * 2
    data = torch.from_numpy(np.ascontiguousarray(pil_set.data))
    assert torch.equal(batches[1][0], gpu_loader.augment_batch(data, torch.arange(16, 32), 0, 0))
    assert batches[1][1].tolist() == list(pil_set.targets[16:32])
