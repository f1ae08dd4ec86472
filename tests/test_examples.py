"""README's first example (examples/moe_layer.py) runs as README says and prints what it claims: the
partitioned MoE chain equal to the unpartitioned one, and its report with the two all-to-alls."""
import re

from helpers import load_script


def test_the_readme_moe_example_runs(capsys):
    load_script("examples", "moe_layer.py").main()
    out = capsys.readouterr().out
    diff = float(out.split("max |partitioned - unpartitioned| = ")[1].split()[0])
    assert diff < 1e-5, out
    assert re.search(r"^ +all-to-all +x2 ", out, re.M) and "fallbacks: 0" in out, out
