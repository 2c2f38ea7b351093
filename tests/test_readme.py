"""The README's example runs and does what it says."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)
    # capacity 0.25 of 64 elements = 16 words + 1 header (int32), all-gathered among 4
    # workers: 3 * 17 * 4 = 204 bytes each way per step, 612 in the three steps.
    total = "[612, 612, 612, 612]"
    assert capsys.readouterr().out == f"WireCount(sent={total}, received={total})\n"
    assert namespace["w"].shape == (4, 8, 8)
