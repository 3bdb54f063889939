"""The README's main benchmark prints a table a person can read: every column and method defined."""
from benchmarks.remat_compare import Row, report


def rows(compile_diff: float) -> list[Row]:
    return [Row("eager", 8 * 2**20, 0.10, 0.0), Row("checkpoint(4 blocks)", 4 * 2**20, 0.15, 0.0),
            Row("torch.compile(budget=0.5)", 5 * 2**20, 0.12, compile_diff),
            Row("remat(50%)", 4 * 2**20, 0.11, 0.0, "predicted peak/eager 0.500", 12.34, 3.21)]


def test_table_ratios_and_legend():
    text = report(rows(0.0), rows(0.0)[0], dropout=0.1)
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["method", "peak", "MiB", "peak/eager", "time/eager"]
    remat_line = next(line for line in lines if line.startswith("remat(50%)"))
    assert remat_line.split()[1:6] == ["4.00", "0.500", "1.100", "12.3", "3.2"]  # setup, again
    assert next(line for line in lines if line.startswith("eager")).split()[5] == "-"  # no cache
    for term in ("peak MiB:", "peak/eager, time/eager:", "setup s:", "again s:", "grad diff:", "checkpoint(N blocks):",
                 "torch.compile(budget=B):", "activation_memory_budget", "remat(B%):"):
        assert term in text, term
    assert "gradients differ" not in text and "other gradients" not in text  # nothing to explain


def test_a_gradient_difference_is_explained():
    text = report(rows(1.7e-2), rows(0.0)[0], dropout=0.1)
    assert "torch.compile's gradients differ" in text and "dropout (p=0.1)" in text
    text = report(rows(1.7e-2), rows(0.0)[0], dropout=0.0)
    assert "computes other gradients than eager" in text
