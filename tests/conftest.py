import sys
from pathlib import Path

# Lets tests `from distributed import run_on_ranks` without making tests/ a package.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: object) -> None:
    """Tests never read or write the developer's cached hardware calibrations (``autotp calibrate``)."""
    import os
    import tempfile

    os.environ["AUTOTP_CACHE_DIR"] = tempfile.mkdtemp(prefix="autotp-cache-")


def pytest_unconfigure(config: object) -> None:
    """The session's cache folder goes with the session."""
    import os
    import shutil

    shutil.rmtree(os.environ.pop("AUTOTP_CACHE_DIR", ""), ignore_errors=True)
