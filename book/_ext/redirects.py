"""Pages that moved keep their old addresses, loaded by _config.yml (sphinx:
local_extensions).

A reader's bookmark, or another site's link, to a chapter that was renamed or split
(the second edition split chapter 12 in two, renumbered chapters, and turned the
appendix of mistakes into the cheat sheet's first table) lands
on a small page at the old address that sends the browser on to the new one, with the
same anchor where the section kept its name, or to the section's new home where it
moved. Without JavaScript the page says where the chapter went, and a refresh goes
there.
"""

import html
import json
from pathlib import Path

# old page -> (new page, {old anchor: "new page#new anchor"} for sections that moved)
MOVED = {
    "notebooks/12_surviving_a_cluster": ("notebooks/12_exact_resume", {
        "five-hardening-steps": "notebooks/12_exact_resume#four-hardening-steps",
        "hardening-step-4-a-dead-rank": "notebooks/13_restarts_and_slurm#a-dead-rank",
        "preemption-a-signal-one-agreed-checkpoint-exit-code-75":
            "notebooks/13_restarts_and_slurm"
            "#preemption-a-signal-one-agreed-checkpoint-exit-code-75",
        "hardening-step-5-the-gpu-loader-advice-no-gpu-here":
            "notebooks/12_exact_resume#hardening-step-4-the-gpu-loader-advice-no-gpu-here",
        "launching-it":
            "notebooks/13_restarts_and_slurm#launching-on-several-nodes-and-under-slurm",
    }),
    # the appendix of mistakes became the cheat sheet's first table; each mistake's
    # section leads to the chapter that runs it
    "notebooks/appendix_common_mistakes": ("book/cheat_sheet", {
        "1-forgetting-set_epoch": "notebooks/03_set_epoch",
        "2-shuffletrue-together-with-a-sampler": "notebooks/01_samplers",
        "3-drop_last-on-the-dataloader-where-the-samplers-was-meant":
            "notebooks/04_batch_sampler#two-different-drop_last-flags",
        "4-evaluating-with-the-padded-duplicates": "notebooks/09_distributed_evaluation",
        "5-an-rng-object-copied-into-every-worker": "notebooks/07_seeding",
        "6-an-iterabledataset-that-every-rank-reads-whole": "notebooks/08_iterable_datasets",
        "7-ranks-with-different-numbers-of-batches":
            "notebooks/04_batch_sampler#finding-the-mismatch-torch_distributed_debugdetail",
        "8-a-cpu-tensor-in-an-nccl-collective": "notebooks/09_distributed_evaluation",
        "9-logging-and-saving-on-every-rank":
            "notebooks/11_cifar10_ddp#one-log-one-checkpoint-and-local_rank-from-torchrun",
        "10-preparing-the-data-on-global-rank-0-only":
            "notebooks/12_exact_resume#hardening-step-3-data-per-node",
        "11-a-learning-rate-not-scaled-with-the-global-batch":
            "notebooks/11_cifar10_ddp#batch-size-and-learning-rate-across-processes",
        "12-torchdistributedlaunch-and---local_rank-instead-of-torchrun-and-local_rank":
            "notebooks/11_cifar10_ddp#one-log-one-checkpoint-and-local_rank-from-torchrun",
        "13-a-non-shuffled-branch-that-strides-over-one-ranks-share":
            "notebooks/10_ddp_from_scratch",
        "14-a-stratified-sampler-that-never-reshuffles-with-workers-as-ranks":
            "notebooks/05_custom_samplers",
        "15-the-nextiterdataloader-prefetch":
            "notebooks/14_loader_throughput#the-tutorials-nextiterdataloader-prefetch",
        "16-chunks-taken-from-the-environment-variables":
            "notebooks/02_distributed_sampler"
            "#a-published-description-of-the-split-and-what-torch-does",
    }),
    "notebooks/05_workers": ("notebooks/06_workers", {}),
    "notebooks/06_seeding": ("notebooks/07_seeding", {}),
    "notebooks/07_iterable_datasets": ("notebooks/08_iterable_datasets", {}),
    "notebooks/08_custom_samplers": ("notebooks/05_custom_samplers", {}),
    "notebooks/13_loader_throughput": ("notebooks/14_loader_throughput", {}),
    "notebooks/14_permutation_sampler": ("notebooks/15_permutation_sampler", {}),
    "notebooks/15_streams_of_shards": ("notebooks/16_streams_of_shards", {}),
}


def _relative(old: str, new: str) -> str:
    """The href from the old page's folder to ``new`` (a page, maybe with #anchor)."""
    page, _, anchor = new.partition("#")
    depth = old.count("/")
    href = "../" * depth + page + ".html"
    return href + (f"#{anchor}" if anchor else "")


def stub(old: str, new: str, sections: dict[str, str]) -> str:
    """The HTML of the page left at ``old``."""
    target = _relative(old, new)
    moved = {anchor: _relative(old, where) for anchor, where in sections.items()}
    script = ("var moved = " + json.dumps(moved, sort_keys=True) + ";\n"
              "var anchor = location.hash.slice(1);\n"
              f"location.replace(moved[anchor] || {json.dumps(target)} + location.hash);")
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f"<title>Moved to {html.escape(new)}</title>",
        f"<script>{script}</script>",
        f'<meta http-equiv="refresh" content="0; url={html.escape(target)}">',
        f'<link rel="canonical" href="{html.escape(target)}">',
        "</head>",
        f'<body><p>This chapter has moved: <a href="{html.escape(target)}">'
        f"{html.escape(new)}</a>.</p></body>",
        "</html>",
        ""])


def write_stubs(outdir: str, pages=(), moved: dict = MOVED) -> list[Path]:
    """A page at each old address; ``pages``, the book's own (Sphinx's docnames), may
    not be among them, and each new one must be."""
    written = []
    for old, (new, sections) in moved.items():
        wanted = [new, *(where.partition("#")[0] for where in sections.values())]
        if pages and (old in pages or not set(wanted) <= set(pages)):
            raise ValueError(f"redirects.MOVED: {old} is a page of the book, or "
                             f"{wanted} are not all pages of it")
        path = Path(outdir) / f"{old}.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stub(old, new, sections), encoding="utf-8")
        written.append(path)
    return written


def _on_build_finished(app, exception):
    if exception is None and app.builder.format == "html":
        write_stubs(app.outdir, pages=set(app.env.found_docs))


def setup(app):
    app.connect("build-finished", _on_build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
