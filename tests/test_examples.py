"""README's first example (examples/moe_layer.py) runs as README says and prints what it claims: the
partitioned MoE chain equal to the unpartitioned one, and its report with the two all-to-alls."""
import importlib.util
import pathlib


def test_the_readme_moe_example_runs(capsys):
    path = pathlib.Path(__file__).parent.parent / "examples" / "moe_layer.py"
    spec = importlib.util.spec_from_file_location("moe_layer_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    diff = float(out.split("max |partitioned - unpartitioned| = ")[1].split()[0])
    assert diff < 1e-5, out
    assert out.count("all-to-all") >= 2 and "fallbacks: 0" in out, out
