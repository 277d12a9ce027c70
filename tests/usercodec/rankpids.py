"""For fault tests that signal one rank: every spawned rank writes its pid to ``rank<RANK>.pid``
in ``$THINWIRE_TEST_PIDS`` (atomically) when imported, so a test knows which process is which
rank. Imported by the launcher too (no ``RANK`` there: nothing written), and a no-op without
``THINWIRE_TEST_PIDS``. Used as ``--import usercodec.rankpids`` or by its path."""

from __future__ import annotations

import os

if os.environ.get("RANK") is not None and os.environ.get("THINWIRE_TEST_PIDS"):
    _path = os.path.join(os.environ["THINWIRE_TEST_PIDS"], "rank" + os.environ["RANK"] + ".pid")
    with open(_path + ".tmp", "w") as _f:
        _f.write(str(os.getpid()))
    os.replace(_path + ".tmp", _path)
