"""Models on the device: the models directory (``directory``, with ``meta``, what an app reads,
and ``guard``, what it protects), the switch of a deployed engine into a named version and its
commit or rollback (``switch``, ``commit_logic``, ``rollback``), model sets (``sets``), the
operator's notes and pins (``notes``), ``removal``, and the app's donated inputs at work
(``live_samples``, ``live_check``)."""
