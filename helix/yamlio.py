"""Reading the project's YAML files (model presets, sweeps, hardware): one error line that names
the file, line and column."""

from __future__ import annotations

import yaml

from helix.errors import ConfigError


def load_yaml(path: str):
    """The parsed document; ConfigError on a missing file or a syntax error (with its position)."""
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {what}") from None
