"""The journal's partial downloads: per artifact, its size, block size and the bitmap of the
blocks received, so a restarted daemon resumes a transfer instead of starting it over.
Functions over the journal's connection, called under its lock (writes in its transactions).
"""

import sqlite3
from typing import Any, Dict, List, Optional, Tuple

_COLUMNS = "sha256, size, block_size, bitmap, updated"


def get(db: sqlite3.Connection, sha256: str) -> Optional[Dict[str, Any]]:
    """A transfer in progress: sha256, size, block_size, bitmap (bit set = block received),
    updated."""
    row = db.execute("SELECT {} FROM transfers WHERE sha256 = ?".format(_COLUMNS),
                     (sha256,)).fetchone()
    return _row(row) if row else None


def put(db: sqlite3.Connection, sha256: str, size: int, block_size: int, bitmap: bytes,
        now: float) -> None:
    db.execute("INSERT OR REPLACE INTO transfers ({}) VALUES (?, ?, ?, ?, ?)".format(_COLUMNS),
               (sha256, int(size), int(block_size), bytes(bitmap), now))


def update(db: sqlite3.Connection, sha256: str, bitmap: bytes, now: float) -> None:
    db.execute("UPDATE transfers SET bitmap = ?, updated = ? WHERE sha256 = ?",
               (bytes(bitmap), now, sha256))


def delete(db: sqlite3.Connection, sha256: str) -> None:
    db.execute("DELETE FROM transfers WHERE sha256 = ?", (sha256,))


def every(db: sqlite3.Connection) -> List[Dict[str, Any]]:
    """Every transfer in progress, least recently updated first."""
    return [_row(r) for r in db.execute(
        "SELECT {} FROM transfers ORDER BY updated".format(_COLUMNS)).fetchall()]


def _row(r: Tuple[Any, ...]) -> Dict[str, Any]:
    return {"sha256": r[0], "size": int(r[1]), "block_size": int(r[2]), "bitmap": bytes(r[3]),
            "updated": float(r[4])}
