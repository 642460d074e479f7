"""Every training command the book prints (utils.book_commands, issue 43): each one's
learning rate is the linear rule's, and ResNet-18 on 4 or more stated GPUs with a
global batch given takes 128 images per GPU; each distinct SimpleCNN recipe has a
rehearsal on the CPU in book/results/book_commands_cpu.json that learned (ResNet-18's
are recorded as not rehearsed: too slow on a CPU). The How-to-run test runs the CPU
rehearsal again and checks that it learns. Parsing is checked on a small text, and the
rule on a copy of the pages with one command changed."""

import json
import os
import re
import shutil

import pytest

from utils import book_commands as bc

RESULTS = os.path.join(bc.ROOT, bc.OUT)
# the rehearsal rerun here: the book's own CPU rehearsal (how_to_run.md), 2 processes

SAMPLE = """\
Prose with `python examples/train_single.py --batch 64` inline, and a mention:
`utils.train_cifar10 --data-format webdataset` (no launcher).

```bash
# a comment line
CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node=gpu \\
    examples/train_ddp.py --model resnet18 --lr 0.2  # a trailing comment
python -m utils.train_cifar10 --prepare-only --synthetic
torchrun --nnodes=2 --nproc-per-node=4 -m utils.train_cifar10 --global-batch 1024 \\
    --model resnet18 --amp ... | tee log
```

```text
python examples/train_single.py --batch 999
```

```{admonition} A note
A span `python -m utils.train_cifar10
--epochs 3` over a line break.
```
"""


def test_commands_are_found_in_shell_blocks_and_inline_code():
    assert bc.shell_commands(SAMPLE) == [
        (1, "python examples/train_single.py --batch 64"),
        (2, "utils.train_cifar10 --data-format webdataset"),
        (6, "CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node=gpu "
            "examples/train_ddp.py --model resnet18 --lr 0.2"),
        (8, "python -m utils.train_cifar10 --prepare-only --synthetic"),
        (9, "torchrun --nnodes=2 --nproc-per-node=4 -m utils.train_cifar10 "
            "--global-batch 1024 --model resnet18 --amp ... | tee log"),
        (18, "python -m utils.train_cifar10 --epochs 3")]
    keys = [r.key() if r else None
            for r in map(bc.parse_command, (c for _, c in bc.shell_commands(SAMPLE)))]
    assert keys == [("train_single.py", "simplecnn", 64, None, "1"), None,
                    ("train_ddp.py", "resnet18", 256, 0.2, "2"), None,
                    ("utils.train_cifar10", "resnet18", 1024, None, "8"),
                    ("utils.train_cifar10", "simplecnn", 256, None, "1")]


def test_the_book_prints_every_script_and_the_slurm_recipe():
    recipes = bc.commands()
    assert {r.script for r in recipes} == set(bc.SCRIPTS)
    slurm = [r for r in recipes if any(bc.SBATCH in p for p in r.places)]
    assert [r.key() for r in slurm] == [
        ("utils.train_cifar10", "resnet18", 2048, None, "16")]


def test_every_command_the_book_prints_follows_the_linear_rule():
    problems = [p for recipe in bc.commands() for p in bc.check_rule(recipe)]
    assert not problems, "\n".join(problems)


def copy_of_the_pages(tmp_path) -> str:
    """The pages and the SLURM recipe under ``tmp_path``, as in the repository."""
    for page in (*bc.PAGES, *bc.NOTEBOOKS, bc.SBATCH):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(bc.ROOT, page), tmp_path / page)
    return str(tmp_path)


def append_to_command(root: str, place: str, words: str) -> None:
    """``words`` at the end of the command printed at ``place`` (``page:line``), before
    its comment."""
    page, line = place.rsplit(":", 1)
    path = os.path.join(root, page)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    last = int(line) - 1
    while lines[last].rstrip().endswith("\\"):
        last += 1
    lines[last] = re.sub(r"\s*(\s#.*)?$", lambda m: f" {words}{m.group(1) or ''}",
                         lines[last], count=1)  # before a comment
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def a_place(predicate) -> str:
    """The first ``page:line`` of a markdown page that prints a command (no pipe) whose
    recipe satisfies ``predicate``."""
    for recipe in bc.found():
        place, printed = recipe.places[0], recipe.printed[0]
        if predicate(recipe) and ".md:" in place and "|" not in printed:
            return place
    pytest.fail("no such command in the book")


def test_a_command_changed_off_the_rule_fails(tmp_path):
    root = copy_of_the_pages(tmp_path)
    place = a_place(lambda r: True)
    append_to_command(root, place, "--lr 9")
    problems = [p for r in bc.commands(root) for p in bc.check_rule(r)]
    assert len(problems) == 1 and place in problems[0], problems
    assert "--lr 9, but the linear rule gives" in problems[0]


def test_every_option_the_book_prints_is_one_its_script_accepts(tmp_path):
    """So the commands a CPU cannot run (ResNet-18 on GPUs, the How-to-run blocks this
    suite skips) cannot fail on a reader's GPUs with an unknown option."""
    assert [u for r in bc.commands() for u in bc.unknown_options(r)] == []
    assert {"--batch", "--data", "--synthetic"} <= bc.script_options("train_single.py")
    root = copy_of_the_pages(tmp_path)
    place = a_place(lambda r: r.script == "train_single.py" and r.model == "resnet18")
    append_to_command(root, place, "--global_batch 64")  # an underscore for the dash
    unknown = [u for r in bc.commands(root) for u in bc.unknown_options(r)]
    assert len(unknown) == 1 and unknown[0].startswith("--global_batch in: "), unknown


def test_resnet18_on_8_gpus_at_64_per_gpu_fails(tmp_path):
    root = copy_of_the_pages(tmp_path)
    place = a_place(lambda r: r.model == "resnet18" and r.processes == 8)
    append_to_command(root, place, "--global-batch 512")
    problems = [p for r in bc.commands(root) for p in bc.check_rule(r)]
    assert len(problems) == 1 and place in problems[0], problems
    assert "64 images per GPU, not the book's 128: --global-batch 1024" in problems[0]


def test_a_script_that_derives_another_rate_fails(monkeypatch):
    recipe = next(r for r in bc.commands() if r.script == "train_single.py")
    monkeypatch.setattr(bc, "base_lr", lambda script: {recipe.model: 0.1})
    assert "train_single.py derives" in "".join(bc.check_rule(recipe))


@pytest.fixture(scope="module")
def recorded() -> dict:
    with open(RESULTS) as f:
        return json.load(f)


def test_every_recipe_has_a_rehearsal_that_learned(recorded):
    problems = bc.rehearsal_problems(recorded, bc.commands())
    assert not problems, "\n".join(problems)
    assert recorded["threshold"] == bc.THRESHOLD >= 4 * bc.CHANCE


def test_a_recipe_without_a_rehearsal_or_below_the_threshold_fails(recorded):
    recipes = bc.commands()
    fewer = {**recorded, "recipes": recorded["recipes"][1:]}
    assert bc.rehearsal_problems(fewer, recipes) == [
        f"no rehearsal of {recipes[0].name()} (printed at "
        f"{'; '.join(recipes[0].places)}): run `python -m utils.book_commands "
        f"--missing --out {bc.OUT}`"]
    first = recorded["recipes"][0]
    gone = {**first, "key": {**first["key"], "global_batch": 7}, "name": "gone"}
    more = {**recorded, "recipes": recorded["recipes"] + [gone]}
    assert bc.rehearsal_problems(more, recipes) == [
        f"a rehearsal of gone, which the book no longer prints: run "
        f"`{recorded['command']}`"]
    worse = json.loads(json.dumps(recorded))
    rehearsed = [e for e in worse["recipes"] if "not_rehearsed" not in e]
    rehearsed[-1]["accuracy"] = bc.THRESHOLD
    assert "scored 0.5" in "".join(bc.rehearsal_problems(worse, recipes))
