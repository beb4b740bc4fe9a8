"""``python -m kda_kcp.demo``, the README's first command: its table of checks, its verdicts and its exit status."""

import re
import subprocess
import sys

import kda_kcp.demo as demo

SMALL = ["--docs", "70", "1", "0", "45", "--heads", "2", "--dim", "16"]
ROW = re.compile(r"^W=\d .*(PASS|FAIL)")


def _rows(text):
    return [line for line in text.splitlines() if ROW.match(line)]


def test_demo_runs():
    out = subprocess.run([sys.executable, "-m", "kda_kcp.demo", *SMALL, "--world", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _rows(out.stdout)
    assert len(rows) == 8 and all(r.rstrip().endswith("PASS") for r in rows), out.stdout
    assert out.stdout.rstrip().endswith("PASS: all 8 checks passed")
    # the columns fit the longest label ("W=1 checkpoint = plain step"): every verdict in one column
    assert len({r.index("PASS") for r in rows}) == 1, out.stdout
    errors = [float(x) for r in rows for x in re.findall(r"\d\.\de[-+]\d\d", r)]
    assert len(errors) == 36 and max(errors) < 4e-3, errors  # BF16 outputs round at ~1.7e-3


def test_a_wrong_result_fails_its_row_and_the_exit_status(monkeypatch, capsys):
    """An error above its bound prints FAIL on that row and makes main return 1."""
    right = demo.oracle

    def off_by_ten_percent(cu, inputs, do):
        ref = right(cu, inputs, do)
        return [ref[0] * 1.1] + ref[1:]

    monkeypatch.setattr(demo, "oracle", off_by_ten_percent)
    assert demo.main([*SMALL, "--world", "0"]) == 1
    text = capsys.readouterr().out
    rows = _rows(text)
    assert len(rows) == 3
    assert rows[0].rstrip().endswith("FAIL (o > 4e-03)") and rows[1].rstrip().endswith("FAIL (o > 4e-03)"), text
    assert rows[2].rstrip().endswith("PASS"), text  # the checkpoint still equals the plain step
    assert text.rstrip().endswith("FAIL: 2 of 3 checks failed")


def test_it_says_which_backend_runs_and_why(monkeypatch):
    import torch

    monkeypatch.delenv("KDA_KCP_BACKEND", raising=False)
    assert demo.backend_line(torch.device("cpu")) == "torch (no CUDA device)"
    monkeypatch.setenv("KDA_KCP_BACKEND", "torch")
    assert demo.backend_line(torch.device("cpu")) == "torch (KDA_KCP_BACKEND=torch)"
