"""Where the repository's own files are, for tests at any depth of tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
DS_CONFIGS = REPO / "ds_configs"
