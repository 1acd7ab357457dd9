"""docs/trainers.md's support matrix: generated from the tests' cell marks and the refusals of
``fastreduce.integrations.cells`` (tests/matrix.py), and current. Not in the quick tier: the
check needs every marked test file collected (the trainers' among them)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_the_trainers_support_matrix_is_generated_and_current(request: pytest.FixtureRequest) -> None:
    """docs/trainers.md's matrix is what tests/matrix.py makes of the tests' cell marks and the
    refusals of fastreduce.integrations.cells now (a new mark, test or refusal: run
    ``python tests/matrix.py --write``). The marks are read from this run's own collection
    (tests/conftest.py) where it holds every marked file; else collected again."""
    import sys

    import matrix  # (tests/ is on the path: conftest imported it)
    from conftest import MATRIX_CELLS

    collector = request.config.stash.get(MATRIX_CELLS, None)
    if collector is None or not matrix.marked_files() <= collector.files:
        import subprocess

        done = subprocess.run([sys.executable, str(ROOT / "tests" / "matrix.py"), "--check"], cwd=ROOT,
                              capture_output=True, text=True, timeout=170)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return
    assert not collector.errors, "\n".join(collector.errors)
    problem = matrix.stale(collector.cells)
    assert problem is None, problem


def test_a_refused_cell_marked_as_tested_is_an_error() -> None:
    """The matrix does not let a test claim a cell the code refuses (one of the two is wrong),
    and names a refusal in the trainers' own words."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import matrix
    from fastreduce.integrations.cells import refusal

    assert "loads onto the world size it was saved at" in refusal("localsgd", "hf", False, "reshard")
    assert refusal("gossip", "lightning", True, "train") is None and refusal("zero", "hf", False, "reshard") is None
    with pytest.raises(SystemExit, match="refused .* but marked as shown"):
        matrix.render({("gossip", "hf", False, "reshard"): {("tests/test_x.py::test_y", "reference")}})
    assert "| fused | tested (T1) |" in matrix.render({("fused", "loop", False, "train"): {("t::a", "reference")}})
