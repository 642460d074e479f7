"""Every training command the book prints: found in its pages, checked against the
linear rule, and rehearsed on the CPU (issue 43).

    commands()            the distinct recipes, each with the places that print it
    check_rule(recipe)    what breaks the book's batch and learning-rate story
    rehearse(recipe, n)   the recipe for n epochs on the generated stand-in, on the CPU

``python -m utils.book_commands --out book/results/book_commands_cpu.json`` rehearses
every recipe (ResNet-18's are recorded as not rehearsed: ``NOT_ON_CPU``);
``tests/test_book_commands.py`` fails when a page prints a command that breaks the
rule or that has no rehearsal in that file.

A command is a line of a shell block (```bash, ```sh or a plain ```; joined over
backslash continuations, comments dropped) or an inline code span that starts with a
launcher (``python``, ``torchrun``, after ``VAR=value`` settings) and runs
``train_ddp.py``, ``train_single.py`` or ``utils.train_cifar10``; ``--prepare-only``
and ``--help`` train nothing and are skipped. A mention (``utils.train_cifar10
--data-format webdataset`` in a table) has no launcher: no command. An argument
``...`` (the rest, as above) names no option: it changes nothing. The SLURM recipe
adds the command that its ``srun`` runs, with its default ``TRAIN_ARGS`` and the
global batch it computes for the nodes and GPUs of its header.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from utils import results
from utils.notebook_times import cell_sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("README.md", "book/how_to_run.md", "book/cheat_sheet.md", "book/intro.md",
         "examples/slurm/README.md")
NOTEBOOKS = ("notebooks/11_cifar10_ddp.ipynb", "notebooks/12_exact_resume.ipynb",
             "notebooks/13_restarts_and_slurm.ipynb")
SBATCH = "examples/slurm/train_cifar10.sbatch"
# each script as the book runs it, and the file that holds its argparse and BASE_LR
SCRIPTS = {"train_ddp.py": "examples/train_ddp.py",
           "train_single.py": "examples/train_single.py",
           "utils.train_cifar10": "utils/train_cifar10/settings.py"}
BATCH_OPTION = {"train_single.py": "--batch"}  # the others: --global-batch
MODULE = "utils.train_cifar10"
RECIPE = "utils/train_cifar10/recipe.py"  # the book's BASE_LR and linear_rule_lr
PER_GPU = 128  # images per GPU for ResNet-18 on GPUs (chapter 11)
GPUS_FROM = 4  # --nproc_per_node=N with N at least this: GPUs, not CPU processes
SHELL = {"", "bash", "sh", "shell", "console"}
STAND_IN = (5000, 1000)  # the generated stand-in's training and test images
CHANCE = 0.1
# SimpleCNN: 3 epochs, as the book's CPU rehearsal. ResNet-18 is not rehearsed on the
# CPU: on 2 CPU ranks it trained at about 10 images/s (2 epochs of the 5,000-image
# stand-in took 20 min 51 s, test accuracy 0.223 at global batch 256), so 6 recipes at
# the epochs that learn would take hours; the GPU check times both scripts with it
EPOCHS = {"simplecnn": 3}
NOT_ON_CPU = {"resnet18": "not rehearsed on the CPU: about 10 images/s on 2 CPU ranks "
                          "(python -m utils.gpu_check --quick runs it on a GPU)"}
# every recipe's rehearsal scored at least this (measured: see the results file)
THRESHOLD = 0.5
OUT = "book/results/book_commands_cpu.json"
SOURCES = ["examples/train_ddp.py", "examples/train_single.py",
           "utils/data.py::write_synthetic_cifar10", "utils/data.py::_synthetic_images",
           "utils/data.py::_write_synthetic_batches",
           "utils/book_commands.py::run_command", "utils/book_commands.py::EPOCHS",
           "utils/book_commands.py::STAND_IN"]

__all__ = ["Recipe", "commands", "found", "check_rule", "rehearse", "shell_commands",
           "parse_command", "rehearsal_problems", "unknown_options"]


@dataclasses.dataclass
class Recipe:
    """A distinct training run the book prints: its key, and where it is printed."""

    script: str  # a key of SCRIPTS
    model: str
    global_batch: int
    lr: float | None  # given with --lr; None: the script derives it
    processes: int | str  # as stated; "gpu": one per GPU (--nproc_per_node=gpu)
    batch_given: bool = dataclasses.field(default=False, compare=False)
    torchrun: bool = dataclasses.field(default=False, compare=False)
    amp: bool = dataclasses.field(default=False, compare=False)
    places: list[str] = dataclasses.field(default_factory=list, compare=False)
    printed: list[str] = dataclasses.field(default_factory=list, compare=False)

    def key(self) -> tuple:
        """What makes two commands the same recipe."""
        return (self.script, self.model, self.global_batch, self.lr,
                str(self.processes))

    def name(self) -> str:
        """The recipe in words."""
        lr = "lr by the rule" if self.lr is None else f"--lr {self.lr:g}"
        return (f"{self.script} --model {self.model}, global batch "
                f"{self.global_batch}, {lr}, processes {self.processes}")


# --- finding the commands in a page ------------------------------------------------


def fenced(text: str) -> tuple[list[tuple[int, str]], list[list[tuple[int, str]]]]:
    """The prose of a markdown text (code blocks blanked, line numbers kept), and its
    shell blocks as lists of ``(line number, line)``. A MyST directive
    (```{admonition}) is prose; a bare fence at least as long closes it."""
    prose, blocks, stack = [], [], []  # stack: (fence length, "code"/"shell"/"prose")
    for number, line in enumerate(text.split("\n"), start=1):
        fence = re.match(r"\s*(`{3,}|~{3,})\s*([^`\s]*)", line)
        in_code = bool(stack) and stack[-1][1] != "prose"
        closing = fence and stack and not fence.group(2)
        if closing and len(fence.group(1)) >= stack[-1][0]:
            stack.pop()
        elif fence and not in_code:
            language = fence.group(2).lower()
            kind = ("prose" if language.startswith("{") else
                    "shell" if language in SHELL else "code")
            stack.append((len(fence.group(1)), kind))
            blocks += [[]] if kind == "shell" else []
        elif in_code:
            if stack[-1][1] == "shell":
                blocks[-1].append((number, line))
            line = ""
        prose.append((number, line if not fence else ""))
    return prose, blocks


def block_commands(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """A shell block's commands, each ``(first line, text)``: lines joined over a
    trailing backslash, comments and a ``$`` prompt dropped."""
    found, start, parts = [], None, []
    for number, line in block:
        text = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        start = number if start is None else start
        if text.endswith("\\"):
            parts.append(text[:-1].strip())
            continue
        command = " ".join(parts + [text.strip()]).strip()
        command = re.sub(r"^\$\s+", "", command)
        if command:
            found.append((start, command))
        start, parts = None, []
    return found


def inline_spans(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The inline code spans of the prose, each ``(line, text)``; a span may run over
    a line break (read as a space)."""
    text = "\n".join(line for _, line in prose)
    first = prose[0][0] if prose else 1
    pattern = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
    return [(first + text.count("\n", 0, m.start()), " ".join(m.group(2).split()))
            for m in pattern.finditer(text)]


def shell_commands(text: str) -> list[tuple[int, str]]:
    """Every command-like text of a markdown text, ``(line, text)``, in order: the
    commands of its shell blocks and its inline code spans."""
    prose, blocks = fenced(text)
    found = inline_spans(prose)
    for block in blocks:
        found += block_commands(block)
    return sorted(found)


# --- reading one command -------------------------------------------------------------


def option(tokens: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``tokens`` (``--x=v`` or ``--x v``)."""
    value = None
    for i, token in enumerate(tokens):
        name, equals, given = token.partition("=")
        if name in names:
            value = given if equals else (tokens[i + 1] if i + 1 < len(tokens) else "")
    return value


def split_launcher(tokens: list[str]) -> tuple[str, list[str], list[str]] | None:
    """``(script, launcher options, script arguments)`` of a command's words after
    its launcher, or ``None`` when it runs none of SCRIPTS."""
    for i, token in enumerate(tokens):
        if token in ("-m", "--module") and i + 1 < len(tokens):
            return ((MODULE, tokens[:i], tokens[i + 2:]) if tokens[i + 1] == MODULE
                    else None)
        if token.endswith(".py"):
            name = os.path.basename(token)
            return (name, tokens[:i], tokens[i + 1:]) if name in SCRIPTS else None
    return None


def launch(tokens: list[str]) -> tuple[bool, dict, list[str]] | None:
    """``(under torchrun, environment settings, words after the launcher)``, or
    ``None`` for a command that starts neither python nor torchrun."""
    env = {}
    while tokens and re.match(r"[A-Za-z_]\w*=", tokens[0]):
        name, _, value = tokens.pop(0).partition("=")
        env[name] = value
    if not tokens:
        return None
    program, rest = tokens[0], tokens[1:]
    if re.search(r"(^|/)torchrun$", program):
        return True, env, rest
    if not re.search(r"(^|/)python[\d.]*$|^\$\{?PYTHON\}?$", program):
        return None
    if rest[:2] == ["-m", "torch.distributed.run"]:
        return True, env, rest[2:]
    return False, env, rest


def processes(torchrun: bool, options: list[str], env: dict) -> int | str:
    """The processes a command states: 1 without torchrun; nodes x processes per node;
    ``"gpu"`` for one per GPU (unless ``CUDA_VISIBLE_DEVICES`` lists them)."""
    if not torchrun:
        return 1
    per_node = option(options, "--nproc_per_node", "--nproc-per-node") or "1"
    nodes = option(options, "--nnodes") or "1"
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if per_node in ("gpu", "auto") and visible:
        per_node = str(len(visible.split(",")))
    if per_node.isdigit() and nodes.isdigit():
        return int(per_node) * int(nodes)
    return per_node if nodes == "1" else f"{nodes}x{per_node}"


def parse_command(text: str, place: str = "") -> Recipe | None:
    """The recipe of one command's text, or ``None`` when it trains none of SCRIPTS
    (or only prepares data, or asks for help)."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    for i, token in enumerate(tokens):  # a pipe, a redirection or a next command
        if token in ("|", "||", "&&", ";", ">", ">>", "&"):
            tokens = tokens[:i]
            break
    launched = launch(tokens)
    split = launched and split_launcher(launched[2])
    if not split or {"--prepare-only", "--help", "-h"} & set(split[2]):
        return None
    script, options, args = split
    defaults = script_defaults(script)
    batch_option = BATCH_OPTION.get(script, "--global-batch")
    batch, lr = option(args, batch_option), option(args, "--lr")
    return Recipe(script, option(args, "--model") or defaults["--model"],
                  int(batch or defaults[batch_option]),
                  None if lr is None else float(lr),
                  processes(launched[0], options, launched[1]),
                  batch_given=batch is not None, torchrun=launched[0],
                  amp="--amp" in args or any(a.startswith("--amp=") for a in args),
                  places=[place], printed=[text])


@functools.lru_cache(maxsize=None)
def script_tree(script: str) -> ast.Module:
    """The syntax tree of the file that holds ``script``'s argparse and BASE_LR."""
    with open(os.path.join(ROOT, SCRIPTS[script]), encoding="utf-8") as f:
        return ast.parse(f.read())


@functools.lru_cache(maxsize=None)
def script_defaults(script: str) -> dict:
    """``{option: default}`` of the script's ``add_argument`` calls, as written."""
    defaults = {}
    for node in ast.walk(script_tree(script)):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "")
                == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant)):
            for keyword in node.keywords:
                if keyword.arg == "default":
                    defaults[node.args[0].value] = ast.literal_eval(keyword.value)
    return defaults


@functools.lru_cache(maxsize=None)
def script_options(script: str) -> frozenset:
    """Every option string of the script's ``add_argument`` calls (``--data``, ...)."""
    calls = [node for node in ast.walk(script_tree(script))
             if isinstance(node, ast.Call)
             and getattr(node.func, "attr", "") == "add_argument"]
    return frozenset(arg.value for node in calls for arg in node.args
                     if isinstance(arg, ast.Constant)
                     and str(arg.value).startswith("-"))


def unknown_options(recipe: Recipe) -> list[str]:
    """The options of the recipe's printed commands that its script does not accept
    (a typo there is a command that fails at once on the reader's GPUs)."""
    unknown = []
    for text in recipe.printed:
        tokens = shlex.split(text, comments=True)
        args = split_launcher(launch(tokens)[2])[2]
        unknown += [f"{token.split('=')[0]} in: {text}" for token in args
                    if token.startswith("--")
                    and token.split("=")[0] not in script_options(recipe.script)]
    return unknown


# --- the book's pages ----------------------------------------------------------------


def page_texts(root: str) -> list[tuple[str, str]]:
    """``(place prefix, markdown text)`` for each page, and each markdown cell of the
    notebooks (``notebooks/x.ipynb cell N``)."""
    texts = []
    for page in PAGES:
        with open(os.path.join(root, page), encoding="utf-8") as f:
            texts.append((page, f.read()))
    for notebook in NOTEBOOKS:
        cells = cell_sources(pathlib.Path(root, notebook))
        texts += [(f"{notebook} cell {i}", source)
                  for i, (kind, source) in enumerate(cells) if kind == "markdown"]
    return texts


def sbatch_command(root: str) -> tuple[int, str, str]:
    """The SLURM recipe's training command on its header's nodes and GPUs, with its
    default TRAIN_ARGS and the global batch it computes: ``(line of TRAIN_ARGS, text,
    "N nodes x G GPUs")``."""
    with open(os.path.join(root, SBATCH), encoding="utf-8") as f:
        text = f.read()

    def find(pattern: str) -> re.Match:
        match = re.search(pattern, text, re.M)
        if not match:
            raise ValueError(f"{SBATCH} no longer has a line matching {pattern!r}")
        return match

    nodes = int(find(r"^#SBATCH --nodes=(\d+)").group(1))
    gpus = int(find(r"^#SBATCH --gpus-per-node=(\d+)").group(1))
    per_gpu = int(find(r"GLOBAL_BATCH=\$\(\((\d+) \* NODES \* GPUS_PER_NODE\)\)")
                  .group(1))
    epochs = find(r"^EPOCHS=\$\{EPOCHS:-(\d+)\}").group(1)
    module = find(r"^TRAIN_MODULE=\$\{TRAIN_MODULE:-(\S+)\}").group(1)
    train_args = find(r"^TRAIN_ARGS=\$\{TRAIN_ARGS:-(.*)\}$")
    line = text.count("\n", 0, train_args.start()) + 1
    command = (f"torchrun --nnodes={nodes} --nproc-per-node={gpus} -m {module} "
               f"--epochs {epochs} --resume --no-progress --global-batch "
               f"{per_gpu * nodes * gpus} {train_args.group(1)}")
    return line, command, f"{nodes} nodes x {gpus} GPUs"


def found(root: str = ROOT) -> list[Recipe]:
    """Every training command the pages print, one recipe per place, in order."""
    every = []
    for prefix, text in page_texts(root):
        for line, command in shell_commands(text):
            recipe = parse_command(command, f"{prefix} line {line}"
                                   if " cell " in prefix else f"{prefix}:{line}")
            every += [recipe] if recipe else []
    line, command, shape = sbatch_command(root)
    every.append(parse_command(command, f"{SBATCH}:{line} (its srun, {shape})"))
    return every


def commands(root: str = ROOT) -> list[Recipe]:
    """The distinct recipes of the book's training commands, each with its places and
    the commands as printed there."""
    recipes: dict[tuple, Recipe] = {}
    for recipe in found(root):
        seen = recipes.setdefault(recipe.key(), dataclasses.replace(
            recipe, places=[], printed=[]))
        seen.places += recipe.places
        seen.printed += [p for p in recipe.printed if p not in seen.printed]
        seen.batch_given |= recipe.batch_given
        seen.amp |= recipe.amp
    return list(recipes.values())


# --- the rule ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def literal(path: str, name: str):
    """The value of the top-level assignment ``name = <literal>`` in ``path``."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return ast.literal_eval(node.value)
    raise ValueError(f"{path} assigns no {name}")


def base_lr(script: str) -> dict:
    """The ``BASE_LR`` dict that ``script`` derives its learning rate from."""
    return dict(literal(RECIPE if script == MODULE else SCRIPTS[script], "BASE_LR"))


def linear_rule_lr(model: str, global_batch: int) -> float:
    """The book's rule (``utils.train_cifar10.recipe.linear_rule_lr``, read here
    without importing torch): the model's rate per 256 images, scaled linearly."""
    return literal(RECIPE, "BASE_LR")[model] * global_batch / 256


def check_rule(recipe: Recipe) -> list[str]:
    """What in ``recipe`` breaks the book's story, as sentences: a learning rate off
    the linear rule, or ResNet-18 on N >= 4 stated GPUs, its global batch given, at
    other than 128 per GPU."""
    rule = linear_rule_lr(recipe.model, recipe.global_batch)
    where = "; ".join(recipe.places)
    problems = []
    used = (recipe.lr if recipe.lr is not None else
            base_lr(recipe.script)[recipe.model] * recipe.global_batch / 256)
    if not math.isclose(used, rule, rel_tol=1e-9):
        how = (f"--lr {recipe.lr:g}" if recipe.lr is not None
               else f"{recipe.script} derives {used:g}")
        problems.append(
            f"{recipe.name()}: {how}, but the linear rule gives {rule:g} "
            f"({base_lr(MODULE)[recipe.model]} per 256 images x "
            f"{recipe.global_batch}/256): "
            f"give --lr {rule:g} or none; printed at {where}")
    stated = isinstance(recipe.processes, int) and recipe.processes >= GPUS_FROM
    if (recipe.model == "resnet18" and recipe.batch_given and stated
            and recipe.global_batch != PER_GPU * recipe.processes):
        problems.append(
            f"{recipe.name()}: {recipe.global_batch / recipe.processes:g} images per "
            f"GPU, not the book's {PER_GPU}: --global-batch "
            f"{PER_GPU * recipe.processes}; printed at {where}")
    return problems


# --- rehearsing ----------------------------------------------------------------------


def stand_in(folder: str) -> str:
    """The default generated stand-in (5,000 + 1,000 images) in ``folder``, written
    once; ``folder``."""
    from utils.data import write_synthetic_cifar10

    write_synthetic_cifar10(folder, *STAND_IN)
    return folder


def run_processes(recipe: Recipe) -> int:
    """The processes of a CPU rehearsal: as stated, at most 2; 2 for one per GPU."""
    if not recipe.torchrun:
        return 1
    return min(recipe.processes, 2) if isinstance(recipe.processes, int) else 2


def run_command(recipe: Recipe, epochs: int, data: str = "stand-in",
                out: str = "runs/rehearsal") -> list[str]:
    """The command that rehearses ``recipe`` on the CPU, from the repository's root:
    its script, model, global batch and --lr (if given) on the stand-in, ``epochs``
    epochs, no DataLoader workers, no --amp (CUDA only)."""
    n = run_processes(recipe)
    launcher = (["python", "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={n}"] if recipe.torchrun else ["python"])
    script = (["-m", MODULE, "--no-progress"] if recipe.script == MODULE
              else [SCRIPTS[recipe.script]])
    lr = [] if recipe.lr is None else ["--lr", f"{recipe.lr:g}"]
    return [*launcher, *script, "--synthetic", "--data", data, "--device", "cpu",
            "--workers", "0", "--model", recipe.model,
            BATCH_OPTION.get(recipe.script, "--global-batch"),
            str(recipe.global_batch), *lr, "--epochs", str(epochs), "--out", out]


def epoch_lines(output: str) -> list[tuple[float, int | None]]:
    """``(test accuracy, steps so far or None)`` of each epoch a run printed: the
    example scripts' ``epoch E/N: ... test accuracy A`` lines, utils.train_cifar10's
    JSON lines."""
    lines = []
    for line in output.splitlines():
        match = re.match(r"epoch \d+/\d+: .*test accuracy ([\d.]+)", line)
        if match:
            lines.append((float(match.group(1)), None))
        elif line.startswith("{") and '"test_accuracy"' in line:
            record = json.loads(line)
            lines.append((record["test_accuracy"], record.get("step")))
    return lines


def steps_of(recipe: Recipe, epochs: int) -> int:
    """The optimizer steps of a rehearsal of the example scripts: full batches only,
    each rank's share of the data cut to a whole number of them."""
    world = 1 if recipe.script == "train_single.py" else run_processes(recipe)
    per_rank = STAND_IN[0] // world
    return epochs * (per_rank // (recipe.global_batch // world))


def run(command: list[str], processes: int, timeout: float) -> tuple[int, str]:
    """``(exit status, stdout and stderr)`` of ``command`` run from the repository's
    root, the cores shared by its ``processes``; on ``timeout``, its whole process
    group is killed and the status is 124."""
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": threads}) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return 124, output
    return proc.returncode, output


def rehearse(recipe: Recipe, epochs: int, data: str | None = None,
             timeout: float = 3600) -> dict:
    """``recipe`` for ``epochs`` epochs on the CPU on the stand-in (in ``data``, or a
    temporary folder): the final test accuracy, the epochs run, the optimizer steps,
    the exit status, the command as run."""
    with tempfile.TemporaryDirectory() as tmp:
        data = stand_in(data or os.path.join(tmp, "stand-in"))
        command = run_command(recipe, epochs, data, os.path.join(tmp, "out"))
        start = time.perf_counter()
        code, output = run([sys.executable, *command[1:]], run_processes(recipe),
                           timeout)
    lines = epoch_lines(output)
    result = {"command_run": shlex.join(run_command(recipe, epochs)),
              "accuracy": lines[-1][0] if lines else None, "epochs": len(lines),
              "steps": (lines[-1][1] if lines and lines[-1][1] is not None
                        else steps_of(recipe, len(lines))),
              "returncode": code, "seconds": round(time.perf_counter() - start, 1)}
    if code or not lines:
        result["output_tail"] = output[-2000:]
    return result


# --- the results file ----------------------------------------------------------------


def record(recipe: Recipe, result: dict) -> dict:
    """One recipe's entry in the results file."""
    return {"key": dict(zip(("script", "model", "global_batch", "lr", "processes"),
                            recipe.key())),
            "name": recipe.name(), "places": recipe.places,
            "printed": recipe.printed, **result,
            "dropped": ["--amp (CUDA only)"] if recipe.amp else []}


def key_of(entry: dict) -> tuple:
    """The recipe key of an entry of the results file."""
    key = entry["key"]
    return (key["script"], key["model"], key["global_batch"], key["lr"],
            str(key["processes"]))


def rehearsal_problems(recorded: dict, recipes: list[Recipe]) -> list[str]:
    """Why a results file does not vouch for ``recipes``: one with no rehearsal, a
    rehearsal of a recipe no longer printed, one that failed or scored at most the
    threshold."""
    entries = {key_of(entry): entry for entry in recorded["recipes"]}
    keys, run = {r.key() for r in recipes}, f"run `{recorded['command']}`"
    missing = f"run `python -m utils.book_commands --missing --out {OUT}`"
    problems = [f"no rehearsal of {r.name()} (printed at {'; '.join(r.places)}): "
                f"{missing}" for r in recipes if r.key() not in entries]
    problems += [f"a rehearsal of {e['name']}, which the book no longer prints: {run}"
                 for key, e in entries.items() if key not in keys]
    problems += [f"{e['name']}: exit status {e['returncode']}, scored {e['accuracy']}"
                 f" after {e['epochs']} epoch(s), not above {recorded['threshold']}"
                 for e in entries.values()
                 if e["key"]["model"] not in NOT_ON_CPU and (
                     e["returncode"]
                     or not (e["accuracy"] or 0) > recorded["threshold"])]
    return problems


def kept(path: str, recipes: list[Recipe]) -> dict[tuple, dict]:
    """The rehearsals in the results file at ``path`` of recipes still printed, by
    key; none if the file is missing or stale (its sources changed since)."""
    if not os.path.exists(path) or results.stale(path):
        return {}
    with open(path) as f:
        entries = json.load(f)["recipes"]
    keys = {recipe.key() for recipe in recipes}
    return {key_of(e): e for e in entries if key_of(e) in keys}


def rehearse_all(recipes: list[Recipe], done: dict[tuple, dict], timeout: float,
                 save: Callable[[list[dict]], None]) -> list[dict]:
    """The results file's entry of each recipe, in order: from ``done``, or rehearsed
    now, SimpleCNN's first; ``save`` gets the entries so far after each rehearsal
    (``--missing`` goes on from there after an interruption)."""
    done = {key: {**entry, **record(recipe, {})} for recipe in recipes
            for key, entry in done.items() if key == recipe.key()}
    with tempfile.TemporaryDirectory() as tmp:
        data = stand_in(tmp)
        for recipe in sorted(recipes, key=lambda r: r.model != "simplecnn"):
            if recipe.key() in done:
                continue
            if recipe.model in NOT_ON_CPU:
                done[recipe.key()] = record(recipe, {
                    "accuracy": None, "epochs": 0, "returncode": 0,
                    "not_rehearsed": NOT_ON_CPU[recipe.model]})
                continue
            print(f"rehearsing {recipe.name()}", flush=True)
            row = record(recipe, rehearse(recipe, EPOCHS[recipe.model], data, timeout))
            done[recipe.key()] = row
            print(json.dumps({k: row[k] for k in ("accuracy", "epochs", "steps",
                                                  "seconds")}), flush=True)
            save([done[r.key()] for r in recipes if r.key() in done])
    return [done[r.key()] for r in recipes]


def main(argv: list[str] | None = None) -> int:
    """Rehearse every recipe the book prints and write the results file."""
    p = argparse.ArgumentParser(prog="python -m utils.book_commands",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=OUT)
    p.add_argument("--missing", action="store_true",
                   help="rehearse only the recipes that --out has no rehearsal of "
                        "(all of them if its sources changed since)")
    p.add_argument("--timeout", type=float, default=3600, help="per rehearsal")
    args = p.parse_args(argv)
    recipes = commands()
    problems = [problem for recipe in recipes for problem in check_rule(recipe)]

    def save(rows: list[dict]) -> None:
        results.write(args.out, {
            "command": f"python -m utils.book_commands --out {OUT}",
            "threshold": THRESHOLD, "chance": CHANCE, "stand_in": list(STAND_IN),
            "epochs": EPOCHS, "rule_problems": problems, "recipes": rows},
            SOURCES + results.package_sources("utils/train_cifar10"))

    rows = rehearse_all(recipes, kept(args.out, recipes) if args.missing else {},
                        args.timeout, save)
    save(rows)
    failed = [r["name"] for r in rows if "not_rehearsed" not in r
              and (r["returncode"] or (r["accuracy"] or 0) <= THRESHOLD)]
    print("\n".join(problems + [f"below {THRESHOLD}: {n}" for n in failed]) or "all ok")
    return 1 if problems or failed else 0


if __name__ == "__main__":
    sys.exit(main())
