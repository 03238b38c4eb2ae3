"""`platform/` is a folder, never a package: the standard-library module must stay importable.

pytest imports the stdlib `platform` before it applies `pythonpath`, so the check runs in a
fresh interpreter with `platform` first on the path, as a user's `PYTHONPATH=platform:.` has it.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import platform, raylane
print(platform.__file__)
print(platform.python_version())
print(raylane.__file__)
"""


def test_standard_library_platform_module_is_not_shadowed():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["platform", "."])}
    done = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    module, version, package = done.stdout.split()
    # The standard library's module (a file of the interpreter's lib), not the folder.
    assert Path(module).name == "platform.py", module
    assert not Path(module).resolve().is_relative_to(ROOT), module
    assert version == ".".join(map(str, sys.version_info[:3]))
    assert Path(package).resolve() == ROOT / "platform" / "raylane" / "__init__.py", package
