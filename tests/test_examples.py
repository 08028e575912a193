"""The README's example runs as documented and prints what it promises."""

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "generate_tiny.py"


def test_generate_tiny_example(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "    1  moe    nvfp4    nvfp4" in out  # the printed precision plan
    completions = [line for line in out.splitlines() if line.endswith("]") and " length " in line]
    assert len(completions) == 4  # 2 prompts x n=2, each stopped by max_tokens
    assert "guided sites [(2, 'expert_hidden'), (2, 'expert_input'), (2, 'k'), (2, 'v')]" in out
