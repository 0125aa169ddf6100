"""Loaded by a ``fleet serve`` the fencing test starts (this folder first on its PYTHONPATH,
``OUTBOX_PROBE`` naming a file): each delete of outbox rows is run row by row in the same
transaction, and the rows the database reports deleted are appended to that file as
``<rows asked> <rows deleted>``: what the process itself removed, whoever else deletes."""

import os

PATH = os.environ.get("OUTBOX_PROBE")
if PATH:
    from agent.fleet.database import db as _db

    _executemany = _db.Db.executemany

    def _counted(self, sql, rows):
        if not sql.startswith("DELETE FROM outbox") or not rows:
            return _executemany(self, sql, rows)
        deleted = 0
        with self.transaction():
            for row in rows:
                deleted += max(0, self.execute(sql, row).rowcount)
        with open(PATH, "a") as f:
            f.write("{} {}\n".format(len(rows), deleted))
        return None

    _db.Db.executemany = _counted
