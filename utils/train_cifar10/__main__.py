"""``python -m utils.train_cifar10`` (and ``torchrun ... -m utils.train_cifar10``): the
package's entry point, ``steps.run``.

Its classes pickle under their modules' names
(``utils.train_cifar10.augment.KeyedAugment``), which a worker started by a fork server
or spawn imports; this file it does not run again: the main module's name,
``utils.train_cifar10.__main__``, ends with ``.__main__``, which multiprocessing skips
in its children (``spawn._fixup_main_from_name``)."""

from utils.train_cifar10 import run

if __name__ == "__main__":
    run()
