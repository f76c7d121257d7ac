"""The benchmark scripts that need no model run as documented (docs/benchmarks.md); their figures
are read by people, not asserted here."""

import os
import re
import subprocess
import sys

from conftest import ROOT


def test_graph_call_prints_a_figure_for_each_setting():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "graph_call.py"), "--calls", "20",
         "--repeats", "2", "--read-mb", "1", "--params", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = re.findall(r"the layers' operator +(.+?): +(\d+) +(\d+)$", result.stdout, re.M)
    assert [name for name, *_ in rows] == ["nothing", "spins 400 us", "reads 1 MB"], result.stdout
