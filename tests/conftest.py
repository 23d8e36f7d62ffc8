import os
from pathlib import Path

# Tests run many ranks on 2 cores: one intra-op thread per process keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).parent
# The end-to-end files first, then the multi-rank ones, then the unit tests.
FOLDERS = ("e2e", "dist", "unit")


def pytest_collection_modifyitems(config, items):
    """The longest files first: `make test` runs the suite in two processes, and pytest-xdist
    hands them whole files in this order, so the end-to-end files (10-60 s each) start early and
    the short unit files fill the end, instead of one process running a long file alone while
    the other has finished (the order within a folder stays)."""

    def folder(item) -> int:
        top = Path(str(item.path)).relative_to(HERE).parts[0]
        return FOLDERS.index(top) if top in FOLDERS else len(FOLDERS)

    items.sort(key=folder)
