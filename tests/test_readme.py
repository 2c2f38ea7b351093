"""The README's example runs and does what it says."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)
    # capacity 0.25 of 64 elements = 16 words + 1 header, all-gathered among 4 workers
    assert "sent=Array([204, 204, 204, 204]" in capsys.readouterr().out
    assert namespace["w"].shape == (4, 8, 8)
