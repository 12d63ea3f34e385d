"""``python -m rollcorr`` (what ``torchrun -m rollcorr train ...`` runs in each process)."""

import sys

from rollcorr.cli import main

sys.exit(main())
