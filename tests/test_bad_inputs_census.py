"""The census of bad and edge inputs (``benchmarks/bad_inputs.py``), run as a test.

Each of its cases feeds one bad or edge input to one public function, in a
child process, and classifies what happened against a reference the case
computes (``dp_accounting`` called directly, a one-example loop, NumPy): a
clear error naming the argument, the right answer, or else a silent wrong
answer or a crash. The suite holds the census to its standard: every case a
clear error or the right answer. The census imports the package the test
process imports (the checkout's, or the installed one, as ``PYTHONPATH``
says). It runs two of its children at a time (``--jobs 2``): each case is
still classified on its own, in the same children as with one at a time, and
a child that dies is still the crash of the case it was running.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import per_example_grads

CENSUS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bad_inputs.py"
ACCEPTED = ("clear error", "right answer")


@pytest.mark.slow
def test_every_bad_or_edge_input_gets_a_clear_error_or_the_right_answer(tmp_path):
    out = tmp_path / "census.json"
    package_root = str(pathlib.Path(per_example_grads.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, str(CENSUS), "--jobs", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    census = json.loads(out.read_text())
    assert pathlib.Path(census["package"]).resolve() == pathlib.Path(per_example_grads.__file__).resolve().parent
    cases = census["cases"]
    assert len(cases) >= 150, f"the census ran {len(cases)} cases"
    failures = [f"{c['name']}: {c['outcome']}: {c['detail']}" for c in cases if c["outcome"] not in ACCEPTED]
    assert not failures, "\n".join(failures)
