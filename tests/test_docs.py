"""The README's and the documentation's Python examples run as written; the site builds; every public name has a page.

Every ```python block of README.md and of docs/**/*.md is extracted and run,
so a new block is tested without anything added here. Each runs in a fresh
namespace (so it must define what it uses) in the test process, with a
temporary working directory; the blocks in ``SUBPROCESS`` run in a child
Python instead, for the reason given there. A block whose first line is a
comment starting ``# Not run by the tests:`` is skipped; the comment must say
why (it is in the page, for the reader). ``CHECKS`` adds, for some blocks,
assertions against an independent reference; every other block must only
run. A block's id is ``"{page}: {heading} #{i}"`` (``page`` relative to the
repository, the nearest ``#``, ``##`` or ``###`` heading above it).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys
from typing import Callable, NamedTuple

import keras
import numpy as np
import pytest

import per_example_grads as peg
from helpers import assert_clipped_sums_close, assert_grads_close, reference_gradients, reference_norms
from tolerances import GRADIENT_RTOL, norm_rtol

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
SKIP_MARK = "# Not run by the tests:"


class Block(NamedTuple):
    heading: str  # "{page}: " and the nearest "# ", "## " or "### " heading above the block
    index: int  # its position among the Python blocks under that heading, from 0
    code: str

    @property
    def id(self) -> str:
        return f"{self.heading} #{self.index}"

    def skip_reason(self) -> str | None:
        """The comment lines that open a skipped block (without the mark), or None if it runs."""
        lines = self.code.splitlines()
        if not lines or not lines[0].startswith(SKIP_MARK):
            return None
        reason = [lines[0][len(SKIP_MARK) :]]
        for line in lines[1:]:
            if not line.startswith("#"):
                break
            reason.append(line.lstrip("#"))
        return " ".join(part.strip() for part in reason).strip()


def readme_python_blocks(text: str, page: str = "") -> list[Block]:
    """Every fenced ```python block of ``text``, in order, with its heading (prefixed by ``page: ``)."""
    blocks: list[Block] = []
    heading, counts = "(top)", {}
    prefix = f"{page}: " if page else ""
    fence = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
    pos = 0
    for match in fence.finditer(text):
        for line in text[pos : match.start()].splitlines():
            if line.startswith(("# ", "## ", "### ")):
                heading = line.lstrip("#").strip()
        pos = match.end()
        if match.group(1) == "python":
            index = counts.get(heading, 0)
            counts[heading] = index + 1
            blocks.append(Block(prefix + heading, index, match.group(2)))
    return blocks


BLOCKS = [b for page in PAGES for b in readme_python_blocks(page.read_text(), str(page.relative_to(ROOT)))]

# Blocks run in a child process, and why.
SUBPROCESS: dict[str, str] = {
    "docs/guides/scaling-out.md: Scaling out (tf.distribute) and restarts #0": (
        "it creates a MirroredStrategy: a second strategy in one process shares collective instance keys "
        "with the first (tests/helpers.py::mirrored_strategy), and a later test's all-reduce "
        "then meets this one's and aborts"
    ),
}
# Blocks that take well under a second; every other block is marked slow.
FAST = {
    "README.md: per_example_grads #0",
    "docs/guides/per-example-gradients.md: Per-example gradients, and what to do with them #0",
    "docs/design/engines.md: The layer-wise engine #0",
    "docs/guides/parameter-server.md: Gradients computed here, applied elsewhere #0",
}


def run_block(block: Block, tmp_path: pathlib.Path, monkeypatch) -> tuple[dict, str]:
    """Runs ``block`` as written from ``tmp_path``; returns ``(namespace, stdout)``.

    In-process blocks print to the captured stdout (read by the checks with
    capsys); a child's stdout is returned.
    """
    monkeypatch.chdir(tmp_path)
    if block.id in SUBPROCESS:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        done = subprocess.run(
            [sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{done.stderr[-4000:]}"
        return {}, done.stdout
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(block.code, f"{README}: {block.id}", "exec"), namespace)
    return namespace, ""


# --- the checks of particular blocks --------------------------------------------------------


def check_quick_example(ns, out, capsys):
    model, loss_fn, x, y = ns["model"], ns["loss_fn"], ns["x"], ns["y"]
    expected = reference_gradients(model, loss_fn, x, y)
    assert_grads_close(ns["grads"], expected)
    norms = reference_norms(expected)
    np.testing.assert_allclose(
        ns["norms"], norms, rtol=norm_rtol(sum(v.numpy().size for v in model.trainable_variables))
    )
    factors = np.minimum(1.0, 1.0 / np.maximum(norms, 1e-30))
    assert_clipped_sums_close(ns["update"], expected, factors)


def check_layer_rule(ns, out, capsys):
    model, x, y, scale = ns["model"], ns["x"], ns["y"], ns["model"].layers[0]
    assert isinstance(peg.rules.rule_for(scale), ns["ScaleRule"])  # the user's rule, not the fallback
    loss = keras.losses.get("sparse_categorical_crossentropy")
    assert_grads_close(ns["grads"], reference_gradients(model, loss, x, y))
    assert ns["grads"][0].shape == [8, 4]


def check_dp_sgd(ns, out, capsys):
    dp, x = ns["dp"], ns["x"]
    assert dp.num_examples == len(x)
    steps = int(dp.dp_steps.numpy())
    printed = capsys.readouterr().out
    assert printed.startswith(f"{steps} steps, epsilon = ")
    # The same steps accounted independently of the model, within the budget of 3.
    expected = peg.dp.compute_epsilon(len(x), 64, None, 1.1, 1e-5, steps=steps)
    assert float(printed.split("epsilon = ")[1]) == pytest.approx(expected, abs=0.005)
    assert expected <= 3.0


def check_correlated_noise(ns, out, capsys):
    dp, x, sigma = ns["dp"], ns["x"], ns["sigma"]
    assert int(dp.dp_steps.numpy()) == 112 and dp.num_examples == len(x)
    # Independently: 112 BandMF steps with 4 bands are ceil(112 / 4) = 28 DP-SGD steps at the part's rate.
    accountant = peg.dp.PrivacyAccountant(sigma, 64 * 4 / len(x))
    accountant.step(28)
    assert accountant.epsilon(1e-5) <= 3.0
    printed = capsys.readouterr().out
    assert float(printed.split("epsilon = ")[1]) == pytest.approx(accountant.epsilon(1e-5), abs=0.005)


def check_audit(ns, out, capsys):
    report, dp = ns["report"], ns["dp"]
    assert report.epsilon_accountant == dp.epsilon(1e-5)
    # Full-batch steps with Dirac canaries: the Gaussian-DP bound is exact here, so it must not exceed the claim
    # (a valid audit errs only with probability 0.05 at a fixed seed; this seed's run is deterministic).
    assert 0 < report.threshold_test.epsilon <= report.epsilon_accountant
    assert f"{report.epsilon_accountant:.2f}" in capsys.readouterr().out


def check_keras_hub(ns, out, capsys):
    dp = ns["dp"]
    assert int(dp.dp_steps.numpy()) == 2 * 8  # two epochs of round(1/q) = 8 Poisson steps
    assert ns["lm"].backbone.token_embedding.trainable_variables == []  # LoRA: only adapters train
    printed = float(capsys.readouterr().out.split("epsilon = ")[1])
    # The same 16 Poisson steps accounted independently of the model (ceil(2 / q) = 16).
    expected = peg.dp.compute_epsilon(256, 32, 2, noise_multiplier=0.8, delta=1e-3)
    assert printed == pytest.approx(expected, abs=0.005)  # printed to 2 decimals


def check_keras_applications(ns, out, capsys):
    changes, model, dp = ns["changes"], ns["model"], ns["dp"]
    assert len(changes) == 52 and all("GroupNormalization" in c for c in changes)  # the comment's count
    kinds = {type(layer).__name__ for layer in model.layers}
    assert "BatchNormalization" not in kinds and "GroupNormalization" in kinds
    assert dp.model is model and peg.dp.validate(model).errors == []


def check_readme_dp(ns, out, capsys):
    dp, x = ns["dp"], ns["x"]
    steps = int(dp.dp_steps.numpy())
    assert steps == 2 * round(len(x) / 64)  # two epochs of round(1/q) Poisson steps
    expected = peg.dp.compute_epsilon(len(x), 64, None, 1.1, 1e-5, steps=steps)  # independently of the model
    assert float(capsys.readouterr().out.split("epsilon = ")[1]) == pytest.approx(expected, abs=0.005)


def check_accumulation(ns, out, capsys):
    model, loss_fn, x, y = ns["model"], ns["loss_fn"], ns["x"], ns["y"]
    mean = [g.mean(axis=0) for g in reference_gradients(model, loss_fn, x, y)]  # the one-example loop, averaged
    assert_grads_close([g[None] for g in ns["full_batch_gradient"]], [m[None] for m in mean])
    assert int(ns["private"].steps.numpy()) == 1 and "1 private step" in capsys.readouterr().out


def check_user_level(ns, out, capsys):
    dp, users = ns["dp"], ns["users"]
    units = len(np.unique(users))
    assert dp.num_examples == units and int(dp.dp_steps.numpy()) == 3 * 10
    # Per user: 30 Poisson steps at q = 0.1 over the users, accounted independently of the model.
    expected = peg.dp.compute_epsilon(units, 0.1 * units, None, 1.0, 1e-4, steps=30)
    assert dp.epsilon(1e-4) == pytest.approx(expected, rel=1e-12)
    assert f"user-level epsilon = {expected:.2f}" in capsys.readouterr().out


def check_sparse_embeddings(ns, out, capsys):
    dp, n, moved, vocab = ns["dp"], ns["n"], ns["moved"], ns["vocab"]
    steps = int(dp.dp_steps.numpy())
    assert steps == 8
    # The epsilon of dense DP-SGD at the same noise multiplier (the split noise is one Gaussian mechanism).
    assert dp.epsilon(1e-5) == pytest.approx(peg.dp.compute_epsilon(n, 64, None, 1.0, 1e-5, steps=steps), rel=1e-12)
    assert 0 < moved.sum() < vocab // 10  # sparse: the selected rows only
    assert f"table rows written: {moved.sum()} of {vocab}" in capsys.readouterr().out


def check_gradients_elsewhere(ns, out, capsys):
    server, worker = ns["server"], ns["worker"]
    assert server is not worker
    # The server moved by -0.1 times the worker's clipped sum: recompute it from the one-example loop.
    x, y, loss = ns["x"], ns["y"], ns["loss"]
    expected = reference_gradients(worker, loss, x, y)
    factors = np.minimum(1.0, 1.0 / np.maximum(reference_norms(expected), 1e-30))
    for w_server, w_worker, e in zip(server.trainable_variables, worker.trainable_variables, expected):
        step = np.tensordot(factors, e, axes=1)
        np.testing.assert_allclose(
            w_server.numpy(), w_worker.numpy() - 0.1 * step, rtol=1e-6, atol=GRADIENT_RTOL * np.abs(step).max()
        )


def check_mirrored(ns, out, capsys):
    out = out or capsys.readouterr().out  # the child's stdout (SUBPROCESS), else this process's
    # One epoch of ceil(1797 / 256) = 8 batches, each one step at q = 256 / 1797.
    steps = int(out.split(" steps")[0])
    assert steps == 8
    expected = peg.dp.compute_epsilon(1797, 256, None, 1.1, 1e-5, steps=steps)  # as if Poisson, as the ledger does
    assert float(out.split("epsilon = ")[1]) == pytest.approx(expected, abs=0.005)


def check_diagnostics(ns, out, capsys):
    report, model, loss_fn, x, y = ns["report"], ns["model"], ns["loss_fn"], ns["x"], ns["y"]
    assert report.num_examples == len(x) and np.isfinite(report.noise_scale_full_data)
    expected = reference_gradients(model, loss_fn, x[:8], y[:8])
    p = sum(v.numpy().size for v in model.trainable_variables)
    np.testing.assert_allclose(report.per_example_norms[:8], reference_norms(expected), rtol=norm_rtol(p))
    assert pathlib.Path("diagnostics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_monte_carlo(ns, out, capsys):
    out = capsys.readouterr().out
    r, ledger = ns["r"], ns["ledger"]
    assert out.strip() == (
        f"Monte Carlo: epsilon = {r.epsilon:.2f} at delta = {r.delta:.2g} ({r.samples} draws); ledger: {ledger:.2f}"
    )
    # The guide's figures: the seed fixes the draws; the ledger's is deterministic.
    assert (round(r.epsilon, 2), round(ledger, 2)) == (4.11, 6.68) and r.delta <= 1e-3


CHECKS: dict[str, Callable] = {
    "README.md: per_example_grads #0": check_quick_example,
    "README.md: per_example_grads #1": check_readme_dp,
    "docs/guides/per-example-gradients.md: Per-example gradients, and what to do with them #0": check_quick_example,
    "docs/guides/accumulation.md: Large logical batches from micro-batches #0": check_accumulation,
    "docs/guides/user-level-privacy.md: User-level privacy #0": check_user_level,
    "docs/guides/sparse-embeddings.md: Sparse embedding noise #0": check_sparse_embeddings,
    "docs/design/engines.md: The layer-wise engine #0": check_layer_rule,
    "docs/guides/private-training.md: Private training with fit (DP-SGD) #0": check_dp_sgd,
    "docs/guides/correlated-noise.md: Correlated noise (BandMF, BLT, BISR) #0": check_correlated_noise,
    "docs/guides/correlated-noise.md: Amplification by a random part (Monte Carlo) #0": check_monte_carlo,
    "docs/guides/auditing.md: Auditing the privacy #0": check_audit,
    "docs/guides/fine-tuning.md: Private fine-tuning of a KerasHub model #0": check_keras_hub,
    "docs/guides/fine-tuning.md: Private training of keras.applications models #0": check_keras_applications,
    "docs/guides/parameter-server.md: Gradients computed here, applied elsewhere #0": check_gradients_elsewhere,
    "docs/guides/scaling-out.md: Scaling out (tf.distribute) and restarts #0": check_mirrored,
    "docs/guides/diagnostics.md: Gradient diagnostics #0": check_diagnostics,
}


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.id, marks=() if b.id in FAST else pytest.mark.slow) for b in BLOCKS],
)
def test_readme_python_block_runs(block, tmp_path, monkeypatch, capsys):
    reason = block.skip_reason()
    if reason is not None:
        assert len(reason) > 20, f"{block.id}: a skipped block must say why, after {SKIP_MARK!r}"
        pytest.skip(reason)
    namespace, out = run_block(block, tmp_path, monkeypatch)
    check = CHECKS.get(block.id)
    if check is not None:
        check(namespace, out, capsys)


def test_every_check_names_a_block():
    """A renamed heading must not silently drop its block's checks (or its subprocess or fast marking)."""
    ids = {b.id for b in BLOCKS}
    assert set(CHECKS) <= ids and set(SUBPROCESS) <= ids and FAST <= ids


def test_block_extraction():
    text = "intro\n```python\na = 1\n```\n## One\n```bash\nls\n```\n```python\nb = 2\n```\n### Two\n```python\n# Not run by the tests: needs a cluster\n```\n"
    blocks = readme_python_blocks(text)
    assert [(b.heading, b.index, b.code) for b in blocks] == [
        ("(top)", 0, "a = 1\n"),
        ("One", 0, "b = 2\n"),
        ("Two", 0, "# Not run by the tests: needs a cluster\n"),
    ]
    assert blocks[0].skip_reason() is None and blocks[2].skip_reason() == "needs a cluster"


PUBLIC_MODULES = (
    "per_example_grads",
    "per_example_grads.dp",
    "per_example_grads.dp.audit",
    "per_example_grads.diagnostics",
    "per_example_grads.keras",
    "per_example_grads.rules",
)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_a_reference_entry(module):
    """Each name of ``__all__`` (but submodules) is rendered from its docstring by a ``::: path`` line of docs/reference."""
    entries = {
        line[4:].strip()
        for page in (ROOT / "docs" / "reference").glob("*.md")
        for line in page.read_text().splitlines()
    }
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if inspect.ismodule(obj):
            continue
        defined = f"{obj.__module__}.{obj.__qualname__}" if hasattr(obj, "__qualname__") else None
        if defined not in entries and not any(e.endswith(f".{name}") for e in entries):
            missing.append(name)
    assert not missing, f"docs/reference has no entry (::: path) for these public names of {module}: {missing}"


@pytest.mark.slow
def test_the_documentation_site_builds_offline_with_warnings_as_errors(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    page = (tmp_path / "site" / "reference" / "dp" / "index.html").read_text()
    assert "noise_multiplier_for_epsilon" in page and "DPAggregator" in page  # rendered from the docstrings


def test_every_page_is_in_the_sites_navigation_and_every_link_resolves():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if p not in nav] == []
    for link in re.findall(r"\]\((docs/[^)#]+)", README.read_text()):  # the README's links into the docs
        assert (ROOT / link).is_file(), link


def test_the_cli_page_holds_every_commands_help_as_the_parser_prints_it(monkeypatch):
    """docs/cli.md's "Every command and option" is each subcommand's --help at 100 columns: regenerate it if this fails."""
    import argparse

    from per_example_grads.apps import cli

    monkeypatch.setenv("COLUMNS", "100")
    page = (ROOT / "docs" / "cli.md").read_text()
    (subcommands,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, parser in subcommands.choices.items():
        want = f"### pegrad {name}\n\n```text\n{parser.format_help().rstrip()}\n```\n"
        assert want in page, f"docs/cli.md: the help of `pegrad {name}` is missing or stale"


def test_ci_runs_the_readme_test_command():
    """.ci/run ends with the README's test command, character for character (the README says it is what CI runs)."""
    text = README.read_text()
    start = text.index("\n## Quickstart\n")
    quickstart = text[start : text.index("\n## ", start + 1)]
    commands = [c.strip() for c in re.findall(r"^```bash\n(.*?)^```", quickstart, re.M | re.S) if "pytest" in c]
    assert len(commands) == 1, "the Quickstart has one bash block that runs the tests"
    ci = [
        line for line in (README.parent / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")
    ]
    assert ci[-1] == commands[0]
