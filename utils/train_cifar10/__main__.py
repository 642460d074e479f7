"""``python -m utils.train_cifar10`` (and ``torchrun ... -m utils.train_cifar10``): the
package's entry point, ``steps.run``.

Its classes pickle under their modules' names
(``utils.train_cifar10.augment.KeyedAugment``), which a worker started by a fork server
or spawn imports; multiprocessing does not run a package's ``__main__`` again in its
workers."""

from utils.train_cifar10 import run

if __name__ == "__main__":
    run()
