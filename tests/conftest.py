import sys
from pathlib import Path

# Lets tests `from distributed import run_on_ranks` without making tests/ a package.
sys.path.insert(0, str(Path(__file__).parent))
