"""The engine package stays free of Django."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_engine_loads_no_django_module():
    code = (
        "import sys, mlxhost.engine, mlxhost.engine.backends.fake;"
        "bad = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_importing_the_engine_does_not_import_mlx():
    """Only the mlx backend imports mlx, and only when chosen."""
    code = "import sys, mlxhost.engine; sys.exit(1 if 'mlx.core' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
