"""``python -m bench [--quick]``: the whole benchmark suite, written to bench/RESULTS.md.

See bench/suite.py and bench/README.md.
"""

import os

# One BLAS thread everywhere (this process and every child): the step-loop workload must
# not compete with itself for the two cores, and children inherit the setting.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import sys  # noqa: E402

from .suite import main  # noqa: E402

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: the processes and boards of this run are removed", file=sys.stderr)
        sys.exit(130)
