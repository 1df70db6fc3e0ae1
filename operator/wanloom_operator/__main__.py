"""`python -m wanloom_operator`: run the operator with settings from the WANLOOM_* environment (see settings.py).

`wanloom operator` does the same with command-line flags on top.
"""

from __future__ import annotations

from wanloom_operator.reconcile.runner import run_operator
from wanloom_operator.settings import OperatorSettings

if __name__ == "__main__":
    run_operator(OperatorSettings.from_env())
