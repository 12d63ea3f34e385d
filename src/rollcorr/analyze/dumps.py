"""The dump format's former address: it lives in ``rollcorr.dumps`` (shared by analyze, the audit and the
drop-ins). ``from rollcorr.analyze.dumps import read_dump, write_dump`` keeps working for code written against
it: this name is that module."""

import sys

from rollcorr import dumps

sys.modules[__name__] = dumps
