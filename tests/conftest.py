"""How the utils tests share the machine when pytest-xdist runs them in parallel.

`make test-utils` runs `pytest -n 2 --dist loadgroup`: two workers take tests as they come,
except the tests of one group, which one worker runs one after the other. The group holds
the tests that start several interpreters at once (torchrun with 2 to 4 ranks, each rank
with DataLoader workers): two of those side by side on a 2-core machine would only slow
each other down, and their timeouts are sized for a machine they have to themselves.
The other tests (in-process, or one child at a time) run beside them.
"""

import pytest

# test files whose tests start several processes at once, for most of their time
STARTS_RANKS = {"test_train_cifar10.py", "test_train_ddp.py", "test_minimal_ddp.py",
                "test_workers.py", "test_streams.py", "test_train_cifar10_shards.py",
                "test_stream_faults.py", "test_shard_index.py", "test_part_scripts.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in STARTS_RANKS:
            item.add_marker(pytest.mark.xdist_group("ranks"))
