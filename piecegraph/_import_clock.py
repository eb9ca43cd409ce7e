"""When ``import piecegraph`` began (imported first by the package, so ``piecegraph.IMPORT_S`` can say what the
import cost without a statement before the package's imports)."""

import time

START = time.perf_counter()
