"""One way to write a matplotlib figure: as PNG, atomically (temp file in the same folder, then rename)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save ``fig`` as a PNG at ``path`` (a reader never sees a half-written file) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
