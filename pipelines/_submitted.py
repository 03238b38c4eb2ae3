"""Make a job import the raylane it was submitted with.

`ray job submit --working-dir .` uploads this repository; without this, the job would import
whichever raylane the cluster's Python has installed (say an older image's). Importing this
module first puts the uploaded `platform/` ahead of it; workers do the same through
`PYTHONPATH=platform` in the job's runtime environment (see docs/guides/clusters.md), and a
run whose workers and driver disagree stops with one line naming them.
"""

import sys
from pathlib import Path

SUBMITTED = Path(__file__).resolve().parents[1] / "platform"

if (SUBMITTED / "raylane" / "__init__.py").is_file() and str(SUBMITTED) not in sys.path:
    sys.path.insert(0, str(SUBMITTED))
